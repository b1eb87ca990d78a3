"""Configuration of a distributed model client."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from protocol.records import ADAPTER_NAME_PATTERN, check_run_id
from protocol.vocab import Quantization, StrEnum, TrainMode, WireDType, choices
from swarm.training.recipe import LRSchedule, RunRecipe, check_overrides
from swarm.training.settings import AveragingSettings
from swarm.trust.swarmkey import SwarmKey


class ForwardSteps(StrEnum):
    """Whether an inference step travels from peer to peer (client -> peer 1 -> peer 2 -> ... -> client)."""

    AUTO = "auto"
    """Pushed on towards a peer whose round trip from this client is at least `forward_min_rtt_s` (on a fast network
    the extra push costs more than the leg it saves)."""
    ALWAYS = "always"
    """Pushed on wherever the peers can."""
    NEVER = "never"
    """The client sends each hop's step itself."""


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How a client finds peers and talks to them."""

    initial_peers: tuple[str, ...]
    """Multiaddrs to join the DHT through (e.g. the bootstrap node's)."""
    dht_prefix: str | None = None
    """Name of the model in the DHT; derived from the model name when None."""
    request_timeout_s: float = 60.0
    """Longest wait for one peer's answer before it counts as failed."""
    connect_timeout_s: float = 10.0
    """Longest wait to open a session on a peer (cache allocation included)."""
    max_retries: int = 4
    """Route changes tried per request after peer failures, before giving up."""
    retry_delay_s: float = 0.5
    """First back-off after a failure; doubles with each retry."""
    directory_refresh_s: float = 5.0
    """A cached view of who serves what is refreshed after this long (and at once after a failure)."""
    wait_for_peers_s: float = 20.0
    """How long to wait for some blocks to be served before raising NoPeersError."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message sent or accepted."""
    max_channels: int = 64
    """gRPC channels kept open to peers at most; beyond it the least recently used idle one is closed."""
    swarm_key: SwarmKey | None = None
    """Key of a private swarm (`SwarmKey.load(FILE)`): gates the DHT and every call to peers; None: public."""
    verify_fraction: float = 0.05
    """Share of forward and backward hops recomputed on another peer to catch wrong results (client/verify.py);
    0 turns spot checks off. Training runs are not checked."""
    verify_inference: float = 0.05
    """Probability, after each inference step, that one span's answers so far are checked by other peers in the
    background (client/inference_checks.py): a peer they outvote is left out and generation redone without it. 0 turns
    the checks off, 1 checks as often as they can run (one at a time)."""
    verify_seed: int | None = None
    """Seed of the spot checks' draws and routes (None: a fresh one per client)."""
    forward_steps: ForwardSteps = ForwardSteps.AUTO
    """Whether inference steps travel from peer to peer (ForwardSteps), each peer still answering the client too;
    True and False are read as ALWAYS and NEVER. Hops reached through libp2p, and peers of protocol version 1, are
    always driven by the client."""
    forward_min_rtt_s: float = 0.005
    """With forward_steps AUTO, the round trip to a peer from which pushing steps to it pays."""
    wire_dtype: WireDType = WireDType.NONE
    """How hidden states and gradients travel between this client and the peers, both ways, and from peer to peer
    on pushed steps (WireDType: none, float16, bfloat16, int8). Lossy but `none`: results then differ from
    the local model's by the rounding (docs/training.md#compressed-activations)."""
    quantization: Quantization = Quantization.NONE
    """Which peers this client uses: those holding their weights as it says (`swarmlm peer --quantize`). Results
    of an int8 or nf4 swarm equal those of the model with its linear weights rounded the same way
    (peer/quantize.py), not the checkpoint's; peers of other quantizations are never used, nor compared with."""
    adapter: str | None = None
    """A named LoRA adapter that peers serve (`swarmlm peer --adapters NAME=DIR`): every request computes with it,
    and only peers that announce it, all with the same digest, are used (the most announced, or the folder's)."""
    adapter_path: str | None = None
    """The adapter's folder, where this client has it: pins the peers' digest to it, and supplies what it replaces
    whole (embeddings, norm, head), which the client computes; an adapter with such modules needs it."""
    min_session_lifetime_s: float = 60.0
    """A peer that ends an inference session at its `--session-lifetime-s` after at least this long is not at fault:
    the session is re-opened and replayed without banning it. Sooner, the peer is treated as failed (a peer that
    ends every session at once would otherwise make the client replay forever)."""

    def __post_init__(self) -> None:
        if self.swarm_key is not None and not isinstance(self.swarm_key, SwarmKey):
            raise ValueError(
                f"swarm_key must be a SwarmKey (swarm.trust.swarmkey.SwarmKey.load(FILE)), got "
                f"{type(self.swarm_key).__name__}"
            )
        if not self.initial_peers:
            raise ValueError(
                "initial_peers is empty; pass the bootstrap node's multiaddr, e.g. /ip4/.../tcp/.../p2p/..."
            )
        for name in (
            "request_timeout_s",
            "connect_timeout_s",
            "directory_refresh_s",
            "max_message_bytes",
            "max_channels",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_retries", "retry_delay_s", "wait_for_peers_s", "min_session_lifetime_s", "forward_min_rtt_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "forward_steps", _forward_steps(self.forward_steps))
        if self.wire_dtype not in choices(WireDType):
            raise ValueError(f"wire_dtype must be one of {choices(WireDType)}, got {self.wire_dtype!r}")
        object.__setattr__(self, "wire_dtype", WireDType(self.wire_dtype))
        if self.quantization not in choices(Quantization):
            raise ValueError(f"quantization must be one of {choices(Quantization)}, got {self.quantization!r}")
        object.__setattr__(self, "quantization", Quantization(self.quantization))
        for name in ("verify_fraction", "verify_inference"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.adapter is not None and not re.fullmatch(ADAPTER_NAME_PATTERN, str(self.adapter)):
            raise ValueError(f"adapter must be 1-64 letters, digits, '_', '.' or '-', got {self.adapter!r}")
        if self.adapter_path is not None and self.adapter is None:
            raise ValueError("adapter_path is the folder of the adapter named by `adapter`: give adapter=NAME too")


def _forward_steps(value: object) -> ForwardSteps:
    """`value` as a ForwardSteps member; True and False, the spellings before the vocabulary, are ALWAYS and NEVER."""
    if isinstance(value, bool):
        return ForwardSteps.ALWAYS if value else ForwardSteps.NEVER
    if isinstance(value, str) and value in choices(ForwardSteps):
        return ForwardSteps(value)
    raise ValueError(f"forward_steps must be one of {choices(ForwardSteps)}, True or False, got {value!r}")


# TrainConfig's fields of the run's recipe (swarm/training/recipe.py), by the recipe's names
_RECIPE_FIELDS = (
    "optimizer",
    "lr",
    "weight_decay",
    "warmup_steps",
    "lr_schedule",
    "total_steps",
    "max_grad_norm",
    "train_mode",
    "lora_rank",
    "averaging_compression",
    "local_steps",
    "outer_lr",
    "outer_momentum",
    "sync_overlap",
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What a trainer does per step (`swarmlm train`); the local reference reads the same fields.

    The fields of the run's recipe (optimizer to max_grad_norm) are None unless given: a trainer adopts the run's
    setting then, or RunRecipe's default when it starts the run; one given must equal the run's.
    """

    run_id: str = "default"
    batch_size: int = 8
    """Samples (sequences) per step from this trainer: its share of the run's batch."""
    micro_batch_size: int = 2
    """Samples per request through the peers; batch_size / micro_batch_size of them are in flight."""
    max_in_flight: int = 0
    """Micro-batches in flight at once (0: all of a step's)."""
    optimizer: str | None = None
    """adamw, adam or sgd."""
    lr: float | None = None
    """Learning rate after warmup."""
    weight_decay: float | None = None
    """Weight decay (not on norms, biases and embeddings)."""
    warmup_steps: int | None = None
    """Updates over which the learning rate rises linearly from 0."""
    lr_schedule: LRSchedule | None = None
    """After warmup: constant, or cosine down to 0 at total_steps."""
    total_steps: int | None = None
    """Updates the run is planned for (a cosine schedule needs it)."""
    max_grad_norm: float | None = None
    """Clip each update to this global gradient norm (0: no clipping)."""
    train_mode: TrainMode | None = None
    """full (every weight) or lora (adapters on the peers' blocks); a trainer trains its embeddings, norm and head
    in both."""
    lora_rank: int | None = None
    """Rank of the LoRA adapters (train_mode lora)."""
    averaging_compression: str | None = None
    """How rounds send gradients: none (exact), float16 or int8."""
    local_steps: int | None = None
    """Updates between the trainers' rounds (1: every update; H > 1: DiLoCo, swarm/training/outer.py)."""
    outer_lr: float | None = None
    """The outer step's learning rate (local_steps > 1)."""
    outer_momentum: float | None = None
    """The outer step's Nesterov momentum (local_steps > 1)."""
    sync_overlap: int | None = None
    """Inner steps a sync's round runs behind (0: waited for; local_steps > 1)."""
    router_aux_loss_coef: float | None = None
    """Weight of a mixture-of-experts model's load-balancing loss (swarm/models/routers.py). None: as transformers
    trains the model, its config's router_aux_loss_coef where it sets output_router_logits, else none; 0: none."""
    averaging: AveragingSettings = field(default_factory=AveragingSettings)
    step_timeout_s: float = 60.0
    """How long to wait for the stages' update, once their samples stop growing, before adding to it again."""
    host: str = "127.0.0.1"
    """Address the trainer's DHT node listens on: trainers average with each other through it."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        for name, value in check_overrides(self.recipe_overrides()).items():
            object.__setattr__(self, name, value)
        if self.batch_size < 1 or self.micro_batch_size < 1 or self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a positive multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if self.router_aux_loss_coef is not None and not 0 <= self.router_aux_loss_coef < float("inf"):
            raise ValueError(f"router_aux_loss_coef must be >= 0 and finite, got {self.router_aux_loss_coef}")
        if self.max_in_flight < 0 or not self.step_timeout_s > 0:
            raise ValueError(
                f"max_in_flight must be >= 0 and step_timeout_s > 0, got {self.max_in_flight}, {self.step_timeout_s}"
            )

    def recipe_overrides(self) -> dict[str, Any]:
        """The settings of the run's recipe given here (not None), by their names in RunRecipe."""
        return {name: getattr(self, name) for name in _RECIPE_FIELDS if getattr(self, name) is not None}

    def recipe(self) -> RunRecipe:
        """The recipe this trainer starts a run with: RunRecipe's defaults, what was given, and its batch as the
        run's (alone, it is the whole batch).

        Raises:
            ValueError: the settings given do not go together (a cosine schedule without total_steps).
        """
        return RunRecipe(**{"batch_size": self.batch_size, **self.recipe_overrides()})
