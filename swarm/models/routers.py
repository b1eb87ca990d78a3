"""The auxiliary load-balancing loss of mixture-of-experts families, computed across the stages of a pipeline.

transformers adds `router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)` to a MoE causal LM's loss
when its config sets `output_router_logits` (Switch Transformer's loss). With T[e] the top-k picks of expert e and
P[e] the sum of its routing probabilities, both over every routed layer and row, and R the rows counted (tokens
times routed layers):

    aux = E * sum_e (T[e] / R) * (P[e] / R)

T, P and R are sums over layers, so each stage returns its own (`RouterStats`) and the trainer adds them up. T has
no gradient, so the loss is linear in each layer's P: d(coef * aux) / dP_layer[e] = coef * E * T[e] / R^2, the same
for every layer (`prob_grad`). The trainer sends that vector with each stage's backward, and the stage adds
sum_e prob_grad[e] * P_stage[e] to what it differentiates: the gradient transformers' loss would give.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, ModelNotFoundError
from swarm.models.checkpoint import causal_lm_class, family_class, meta_causal_lm


def moe_shape(config: PretrainedConfig) -> tuple[int, int] | None:
    """(experts, experts per token) of a mixture-of-experts model whose training in transformers can add this
    load-balancing loss (its family defines `load_balancing_loss_func`: not DeepSeek's, balanced without one);
    None for any other model."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k or router_recorder(config) is None:
        return None
    if not hasattr(importlib.import_module(causal_lm_class(config).__module__), "load_balancing_loss_func"):
        return None
    return int(experts), int(top_k)


@dataclass(frozen=True)
class MoeLayout:
    """What a client needs to know of a mixture-of-experts model to ask for and check its stages' router sums."""

    experts: int
    top_k: int
    routed: tuple[bool, ...]
    """Per block: whether it routes (Qwen2-MoE's `mlp_only_layers` do not)."""

    def routed_in(self, start: int, end: int) -> int:
        return sum(self.routed[start:end])


def moe_layout(config: PretrainedConfig) -> MoeLayout | None:
    """The model's MoeLayout (None for a dense model): which blocks have a router, as its causal LM builds them on
    the meta device."""
    shape, recorder = moe_shape(config), router_recorder(config)
    if shape is None:
        return None
    layers = meta_causal_lm(config).base_model.layers
    routed = tuple(any(isinstance(m, recorder.target_class) for m in layer.modules()) for layer in layers)
    return MoeLayout(*shape, routed)


def aux_coefficient(config: PretrainedConfig, given: float | None = None) -> float:
    """The weight of the load-balancing loss in this model's training loss (0: none): `given`, or by default the one
    transformers gives it (the config's router_aux_loss_coef where it sets output_router_logits).

    Raises:
        ValueError: a weight given for a model that has no routers.
    """
    if moe_shape(config) is None:
        if given:
            raise ValueError(
                f"model type {config.model_type!r} has no load-balancing loss in transformers (a dense model, or "
                f"experts balanced otherwise): leave out --router-aux-loss-coef"
            )
        return 0.0
    if given is not None:
        return float(given)
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def router_recorder(config: PretrainedConfig):
    """transformers' own record of where a family's router logits come from (module class, output index)."""
    try:
        pretrained = family_class(config, "PreTrainedModel")
    except ModelNotFoundError:
        return None
    return (getattr(pretrained, "_can_record_outputs", None) or {}).get("router_logits")


@dataclass
class RouterStats:
    """One stage's sums over its routed layers: top-k picks and routing probabilities per expert, and rows.

    `probs` stays in the autograd graph of the forward that recorded it (when that forward built one).
    `row_weights`: the attention mask flattened to the router's rows (padding counts for nothing), or None.
    """

    experts: int
    top_k: int
    row_weights: torch.Tensor | None = None
    counts: torch.Tensor = field(init=False)
    probs: torch.Tensor | None = field(init=False, default=None)
    rows: float = field(init=False, default=0.0)

    def __post_init__(self):
        self.counts = torch.zeros(self.experts, dtype=torch.float64)

    def add_logits(self, logits: torch.Tensor) -> None:
        """Count one layer's router logits [rows, experts], as transformers' load_balancing_loss_func does."""
        row_weights = self.row_weights
        weights = torch.nn.functional.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        if row_weights is None:
            picks = torch.bincount(selected.reshape(-1).cpu(), minlength=self.experts)
            probs = weights.float().sum(dim=0)
            rows = float(weights.shape[0])
        else:
            picks = torch.zeros(self.experts, dtype=torch.float64).scatter_add_(
                0, selected.reshape(-1).cpu(), row_weights.double().cpu().repeat_interleave(self.top_k)
            )
            probs = (weights.float() * row_weights.to(weights.device, torch.float32).unsqueeze(-1)).sum(dim=0)
            rows = float(row_weights.sum())
        self.counts += picks.double()
        self.probs = probs if self.probs is None else self.probs + probs
        self.rows += rows

    def to_message(self) -> pb.RouterStats:
        probs = self.probs.detach().double().cpu().tolist() if self.probs is not None else []
        return pb.RouterStats(counts=self.counts.tolist() if self.rows else [], probs=probs, rows=self.rows)


@contextlib.contextmanager
def recording(layer: nn.Module, stats: RouterStats | None, config: PretrainedConfig) -> Iterator:
    """Add the router logits that `layer` computes inside the block to `stats` (None: record nothing)."""
    recorder = router_recorder(config) if stats is not None else None
    if recorder is None:
        yield
        return

    def hook(module, args, output):
        logits = output[recorder.index] if isinstance(output, (tuple, list)) else output
        stats.add_logits(logits)

    handles = [m.register_forward_hook(hook) for m in layer.modules() if isinstance(m, recorder.target_class)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class RouterTotals:
    """The stages' stats added up: what the trainer computes the loss and its gradient from."""

    counts: torch.Tensor  # float64 [experts]
    probs: torch.Tensor  # float64 [experts]
    rows: float
    experts: int

    @classmethod
    def add(cls, stats: Sequence[tuple[Sequence[float], Sequence[float], float]], experts: int) -> RouterTotals:
        counts, probs, rows = torch.zeros(experts, dtype=torch.float64), torch.zeros(experts, dtype=torch.float64), 0.0
        for c, p, r in stats:
            if r:
                counts += torch.tensor(c, dtype=torch.float64)
                probs += torch.tensor(p, dtype=torch.float64)
                rows += r
        return cls(counts, probs, rows, experts)

    def loss(self) -> float:
        """transformers' load_balancing_loss_func over every stage's layers (0 with no routed row)."""
        return float(balance_loss(self.probs, self.counts, self.rows, self.experts))

    def prob_grad(self, coef: float) -> list[float]:
        """d(coef * loss) / dP of every layer (empty with no routed row: nothing to add)."""
        if not self.rows or not coef:
            return []
        return (coef * self.experts * self.counts / self.rows**2).tolist()


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, rows, experts: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func from the sums (differentiable in `probs`; 0 with no routed row)."""
    if not float(rows):
        return probs.sum() * 0
    return experts * ((counts / rows) * (probs / rows)).sum()


def check_stats(
    message, experts: int, top_k: int, peer: str, rows_expected: float | None = None
) -> tuple[list[float], list[float], float]:
    """A stage's reported RouterStats, refused unless it is what a forward of real rows can give (`rows_expected`:
    the rows its routed layers counted, where the caller knows them).

    Raises:
        ValueError: naming what is wrong (the caller treats the peer as faulty).
    """
    counts, probs, rows = list(message.counts), list(message.probs), float(message.rows)
    if rows_expected is not None and not math.isclose(rows, rows_expected, rel_tol=1e-9):
        raise ValueError(
            f"peer {peer} reported router sums over {rows:g} rows; its routed layers have {rows_expected:g} (an older "
            f"peer ignores the request for them)"
        )
    if not rows and not counts and not probs:
        return counts, probs, rows
    if len(counts) != experts or len(probs) != experts:
        raise ValueError(f"peer {peer} reported router stats for {len(counts)}/{len(probs)} experts, not {experts}")
    values = [*counts, *probs, rows]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"peer {peer} reported router stats that are negative or not finite")
    # every routed row picks top_k experts and its probabilities sum to 1 (to 2%: a bfloat16 peer's softmax rounds)
    if not math.isclose(sum(counts), rows * top_k, rel_tol=1e-6) or not math.isclose(sum(probs), rows, rel_tol=2e-2):
        raise ValueError(f"peer {peer} reported router stats that no forward gives (picks or probabilities vs rows)")
    return counts, probs, rows


def check_prob_grad(values: Sequence[float], experts: int) -> torch.Tensor | None:
    """The router gradient a backward request carries, as a tensor (None: none sent).

    Raises:
        BadRequestError: not one finite value per expert of the model.
    """
    if not values:
        return None
    if len(values) != experts:
        raise BadRequestError(f"router_grad has {len(values)} values; send one per expert ({experts}), or none")
    grad = torch.tensor(list(values), dtype=torch.float32)
    if not torch.isfinite(grad).all():
        raise BadRequestError("router_grad is not finite")
    return grad
