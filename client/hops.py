"""What a sequence's calls carry and keep: the hop records of a forward (for its backward), training tags, and the
training backwards a peer answered. Shared by client/sequence.py, client/hop_checks.py and client/training/."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from client.routing import RouteHop
from swarm.models.routers import MoeLayout


@dataclass(frozen=True)
class TrainingTag:
    """Marks backward calls as training steps of `run_id`, computed against each stage's update `epochs`."""

    run_id: str
    epochs: Mapping[tuple[int, int], int]
    micro_batch: tuple[str, int, int] | None = None
    """(trainer, index, samples): the micro-batch's id, which a peer adds to its update once."""


@dataclass(frozen=True, eq=False)  # identity: its tensors have no truth value
class TakenBackward:
    """A training backward that a peer answered: what to send again if that peer leaves before its stage updates."""

    hop: RouteHop
    inputs: torch.Tensor
    grad: torch.Tensor
    router_grad: tuple[float, ...] = ()
    """Per expert, the loss's gradient w.r.t. the hop's router sums (a mixture-of-experts loss; else empty)."""


@dataclass
class HopRecord:
    """What one hop of a forward pass was sent, kept for its backward."""

    hop: RouteHop
    inputs: torch.Tensor
    backward_id: str = ""
    """Under which id the peer was asked to keep this hop's activations ("" if it was not)."""
    router: list[tuple[list[float], list[float], float]] | None = None
    """The hop's router sums (counts, probabilities, rows), one per request, where the forward asked for them."""


@dataclass
class RouterReport:
    """Collects one hop's router sums as its answers come (a hop cut into pieces of rows answers several)."""

    moe: MoeLayout
    parts: list[tuple[list[float], list[float], float]] = field(default_factory=list)
