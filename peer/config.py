"""Configuration of a peer daemon (and of its training), checked before anything heavy is imported."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from peer.admission import WorkLimits
from protocol.records import ADAPTER_NAME_PATTERN, MAX_ADAPTERS, MAX_THROUGHPUT, check_run_id, max_update_period_s
from protocol.vocab import DType, Offload, Quantization, StrEnum, TrainMode, choices
from swarm.training.recipe import LRSchedule, RunRecipe, check_overrides, check_setting
from swarm.training.settings import AveragingSettings
from swarm.trust.swarmkey import SwarmKey


class TransportMode(StrEnum):
    """How a peer chooses the transport it announces (protocol.vocab.Transport)."""

    AUTO = "auto"
    """Direct if a neighbour can connect to the endpoint, otherwise p2p through a relay."""
    DIRECT = "direct"
    """gRPC at the announced endpoint."""
    P2P = "p2p"
    """gRPC through libp2p streams of the peer's DHT node."""


class DTypeChoice(StrEnum):
    """The compute dtype a peer is told to run: the checkpoint's, or one of protocol.vocab.DType."""

    AUTO = "auto"
    FLOAT32 = DType.FLOAT32.value
    BFLOAT16 = DType.BFLOAT16.value
    FLOAT16 = DType.FLOAT16.value


class QuantizeChoice(StrEnum):
    """How a peer is told to hold its linear weights: one of protocol.vocab.Quantization, or auto (peer/capacity.py:
    the least rounding at which the blocks asked for fit)."""

    NONE = Quantization.NONE.value
    INT8 = Quantization.INT8.value
    NF4 = Quantization.NF4.value
    AUTO = "auto"


def _member(vocabulary: type[StrEnum], name: str, value: object) -> StrEnum:
    """`value` as a member of `vocabulary` (a plain string is accepted), or a ValueError naming the field."""
    if value not in choices(vocabulary):
        raise ValueError(f"{name} must be one of {choices(vocabulary)}, got {value!r}")
    return vocabulary(value)


WILDCARD_HOSTS = ("0.0.0.0", "::", "")  # listen on every interface: never an address to announce


# TrainingConfig's fields of the run's recipe -> their names in RunRecipe
_RECIPE_FIELDS = {
    "optimizer": "optimizer",
    "lr": "lr",
    "weight_decay": "weight_decay",
    "warmup_steps": "warmup_steps",
    "lr_schedule": "lr_schedule",
    "total_steps": "total_steps",
    "max_grad_norm": "max_grad_norm",
    "target_batch_size": "batch_size",
    "mode": "train_mode",
    "lora_rank": "lora_rank",
    "averaging_compression": "averaging_compression",
    "local_steps": "local_steps",
    "outer_lr": "outer_lr",
    "outer_momentum": "outer_momentum",
    "sync_overlap": "sync_overlap",
}


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How a peer trains the blocks it serves (`swarmlm peer ... --train`).

    The fields of the run's recipe (optimizer to lora_rank) are None unless given: the peer adopts the run's setting
    then, or RunRecipe's default when it starts the run; one given must equal the run's.
    """

    run_id: str = "default"
    """Peers of one run and one span average together; trainers name the run they feed."""
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
    target_batch_size: int | None = None
    """Samples per update, all trainers together (the recipe's batch_size)."""
    mode: TrainMode | None = None
    """full: train every weight of the span; lora: train LoRA adapters of its linear layers only."""
    lora_rank: int | None = None
    """Rank of the LoRA adapters."""
    averaging_compression: str | None = None
    """How rounds send gradients: none (exact), float16 or int8."""
    local_steps: int | None = None
    """Updates between the group's rounds (1: every update; H > 1: DiLoCo, swarm/training/outer.py)."""
    outer_lr: float | None = None
    """The outer step's learning rate (local_steps > 1)."""
    outer_momentum: float | None = None
    """The outer step's Nesterov momentum (local_steps > 1)."""
    sync_overlap: int | None = None
    """Inner steps a sync's round runs behind (0: waited for; local_steps > 1)."""
    averaging: AveragingSettings = field(default_factory=AveragingSettings)
    save_dir: str | None = None
    """Save the span's weights and optimizer state here, and resume from them on restart."""
    save_every: int = 0
    """Save every this many updates (0: only when the peer stops)."""

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.mode is not None:
            object.__setattr__(self, "mode", _member(TrainMode, "train mode", self.mode))
        for name, setting in _RECIPE_FIELDS.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_setting(setting, getattr(self, name), name))
        check_overrides(self.recipe_overrides())  # settings that go together, where all are given
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")

    def recipe_overrides(self) -> dict[str, Any]:
        """The settings of the run's recipe given here (not None), by their names in RunRecipe."""
        return {
            setting: getattr(self, name) for name, setting in _RECIPE_FIELDS.items() if getattr(self, name) is not None
        }

    def recipe(self) -> RunRecipe:
        """The recipe this peer starts a run with: RunRecipe's defaults and what was given.

        Raises:
            ValueError: the settings given do not go together (a cosine schedule without total_steps).
        """
        return RunRecipe(**self.recipe_overrides())


@dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """What a peer allows the requests and the inference sessions it serves."""

    alloc_timeout_s: float = 10.0
    """How long a new session waits for cache space before it gets CacheFullError, unless it asks for a wait."""
    max_alloc_timeout_s: float = 60.0
    """Longest wait for cache space a client may ask for."""
    session_timeout_s: float = 300.0
    """An inference session idle this long is closed and its cache freed."""
    session_lifetime_s: float = 3600.0
    """An inference session is closed this long after it opened, however busy: no one keeps cache forever."""
    write_timeout_s: float = 30.0
    """A session whose client does not read a response within this long is closed."""
    open_timeout_s: float = 10.0
    """A stream that opens no session within this long is closed: until then it only holds one of the peer's
    concurrent calls."""
    max_streams_per_source: int = 256
    """Inference streams one client address (all clients tunneled through libp2p together) may hold at once;
    beyond, a new one is refused with OverloadedError, so that no one source takes every concurrent call."""
    max_batch_tokens: int = 2048
    """Tokens of one inference forward: concurrent sessions' decode steps are batched up to it, and a longer
    prefill is computed in chunks of it, other sessions' decode steps running between the chunks."""
    activation_cache_bytes: int = 1024 * 1024 * 1024
    """Memory for forward activations kept for their backward (0: always recompute in backward)."""
    activation_ttl_s: float = 60.0
    """How long kept activations wait for their backward."""
    work: WorkLimits = field(default_factory=WorkLimits)
    """Caps on one request and on the work queued for the compute thread."""

    def __post_init__(self) -> None:
        for name in (
            "alloc_timeout_s",
            "max_alloc_timeout_s",
            "session_timeout_s",
            "session_lifetime_s",
            "write_timeout_s",
            "open_timeout_s",
            "max_streams_per_source",
            "activation_ttl_s",
            "max_batch_tokens",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.activation_cache_bytes < 0:
            raise ValueError(f"activation_cache_bytes must be >= 0, got {self.activation_cache_bytes}")


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """What a peer serves and how; the CLI maps its flags onto this."""

    model: str
    """Local checkpoint folder, or a hub id already in the local cache."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm (e.g. the bootstrap node's)."""
    blocks: tuple[int, int] | None = None
    """Serve blocks [start, end); None picks the blocks the swarm covers least."""
    num_blocks: int | None = None
    """How many blocks to serve when `blocks` is not given; None serves all that fit."""
    dht_prefix: str | None = None
    """Name of the model in the DHT; derived from `model` when None."""
    host: str = "127.0.0.1"
    """Address the gRPC and DHT endpoints listen on (and announce)."""
    port: int = 0
    """gRPC port; 0 picks a free one."""
    announce_host: str | None = None
    """Announce this "HOST" or "HOST:PORT" instead of where the peer listens (port forwarding, a proxy)."""
    dht_port: int = 0
    """DHT (libp2p) port; 0 picks a free one."""
    transport: TransportMode = TransportMode.AUTO
    """How clients reach this peer: "direct" (gRPC at the announced endpoint), "p2p" (gRPC through libp2p
    streams), or "auto": direct if a neighbour can connect to the endpoint, otherwise p2p through a relay."""
    relay: bool = False
    """Also forward streams to peers behind NAT (for a peer that others can connect to)."""
    device: str = "cpu"
    dtype: DTypeChoice = DTypeChoice.AUTO
    """Compute dtype: auto (the checkpoint's), float32, bfloat16 or float16."""
    quantization: QuantizeChoice = QuantizeChoice.NONE
    """Hold the blocks' linear weights as int8 or nf4 (peer/quantize.py); only clients that ask for that
    quantization use the peer. auto: the least rounding at which the blocks asked for fit (peer/capacity.py); full
    precision for a training peer or one serving adapters."""
    adapters: dict[str, str] = field(default_factory=dict)
    """Named LoRA adapters to serve beside the weights, name -> peft adapter folder (peer/adapters.py); a client
    picks one per session."""
    expert_cache: int = 0
    """Experts of each MoE layer kept on the device (the rest in host memory, brought in when picked:
    peer/experts.py); 0 keeps every expert resident."""
    expert_prefetch: bool = False
    """With expert_cache: bring in the experts the next layer's router would pick, before that layer runs (off by
    default: it raises the hit rate on a trained model but copies more, and its copies beside the compute have not
    run on a GPU yet; bench/experts.py)."""
    expert_store: str = "host"
    """With expert_cache: where the experts off the device wait, "host" memory or "disk" (files under cache_dir,
    read when picked: host memory then holds expert_cache experts a layer, and loading one block's)."""
    memory_budget: int | None = None
    """Bytes of block weights and KV cache resident at once (peer/offload.py); None: no budget."""
    offload: Offload = Offload.NONE
    """Where the blocks that `memory_budget` does not hold wait: nowhere (they must fit), host memory or disk."""
    cache_tokens: int = 8192
    """KV-cache budget in tokens (each session reserves batch x max_length); a memory budget may lower it."""
    max_cache_share: float = 0.5
    """Most of the cache budget that the sessions of one client address may hold together."""
    serving: ServingLimits = field(default_factory=ServingLimits)
    """Timeouts, lifetimes and caps of the requests and sessions served."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message accepted or sent."""
    max_concurrent_rpcs: int = 1024
    """Calls served at once (an inference stream counts as one for its whole life); beyond, gRPC refuses new ones
    with RESOURCE_EXHAUSTED, which clients read as OverloadedError."""
    update_period_s: float = 30.0
    """How often the peer re-announces itself; records expire after about twice that."""
    rebalance_period_s: float = 60.0
    """Roughly how often a peer that chose its own blocks checks whether moving would help the swarm."""
    balance_margin: float = 0.15
    """Move only if the swarm's bottleneck throughput would rise by more than this fraction."""
    num_threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    throughput: float | None = None
    """Announced throughput in tokens/s; None measures it once and caches the result."""
    cache_dir: str | None = None
    """Where measured throughput and the peer's key (identity/peer-N.key) are kept; None: the swarmlm cache dir."""
    identity_path: str | None = None
    """The peer's key file (its peer id, which signs its records); None takes a free one in the cache dir."""
    training: TrainingConfig | None = None
    """Train the served blocks with the other peers of the same span and run; None serves them frozen."""
    swarm_key: SwarmKey | None = None
    """Key of a private swarm: its DHT and every call are gated by it (TLS and per-call tags); None: public."""

    def _check_adapters(self) -> None:
        if not self.adapters:
            return
        if len(self.adapters) > MAX_ADAPTERS:
            raise ValueError(f"a peer serves at most {MAX_ADAPTERS} adapters, got {len(self.adapters)}")
        for name in self.adapters:
            if not isinstance(name, str) or not re.fullmatch(ADAPTER_NAME_PATTERN, name):
                raise ValueError(f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if self.training is not None:
            raise ValueError("a training peer serves the run's own weights: drop --adapters or --train")
        if self.quantization not in (QuantizeChoice.NONE, QuantizeChoice.AUTO):
            raise ValueError(
                f"adapters are served on full-precision weights only: drop --adapters or --quantize {self.quantization}"
            )
        if self.offload != Offload.NONE:
            raise ValueError(
                f"adapters are served on resident blocks only: drop --adapters or --offload {self.offload}"
            )

    def _check_memory(self) -> None:
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget}")
        if self.offload == Offload.NONE:
            return
        if self.memory_budget is None:
            raise ValueError(f"--offload {self.offload} streams what a budget does not hold: give --memory-budget too")
        if self.training is not None:
            raise ValueError(f"a training peer updates every block each step: drop --offload {self.offload} or --train")
        if self.blocks is None and self.num_blocks is None:
            raise ValueError(
                f"with --offload {self.offload} the budget no longer bounds how many blocks to serve: "
                f"give --blocks START:END or --num-blocks N"
            )
        if self.offload == Offload.HOST and not self.device.startswith("cuda"):
            raise ValueError(
                f"--offload host keeps blocks in host memory, which on --device {self.device} is the memory the budget "
                f"limits: use --offload disk"
            )

    def __post_init__(self) -> None:
        if self.swarm_key is not None and not isinstance(self.swarm_key, SwarmKey):
            raise ValueError(f"swarm_key must be a SwarmKey (SwarmKey.load(FILE)), got {type(self.swarm_key).__name__}")
        if self.blocks is not None:
            start, end = self.blocks
            if not 0 <= start < end:
                raise ValueError(f"blocks must be start:end with 0 <= start < end, got {start}:{end}")
            if self.num_blocks is not None:
                raise ValueError("give either blocks or num_blocks, not both")
        if self.training is not None and self.blocks is None:
            raise ValueError(
                "a training peer needs fixed blocks: pass --blocks START:END with --train "
                "(the stages of a run do not move)"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        object.__setattr__(self, "transport", _member(TransportMode, "transport", self.transport))
        object.__setattr__(self, "dtype", _member(DTypeChoice, "dtype", self.dtype))
        object.__setattr__(self, "quantization", _member(QuantizeChoice, "quantization", self.quantization))
        object.__setattr__(self, "offload", _member(Offload, "offload", self.offload))
        self._check_memory()
        if self.training is not None and self.quantization not in (QuantizeChoice.NONE, QuantizeChoice.AUTO):
            raise ValueError(
                f"a training peer updates full-precision weights: drop --quantize {self.quantization} or --train"
            )
        self._check_adapters()
        if self.expert_cache < 0:
            raise ValueError(f"expert_cache must be >= 0 (0: every expert resident), got {self.expert_cache}")
        if self.expert_cache and self.training is not None:
            raise ValueError("a training peer updates every expert: drop --expert-cache or --train")
        if self.expert_cache and self.offload != Offload.NONE:
            raise ValueError(f"--expert-cache keeps blocks resident: drop --expert-cache or --offload {self.offload}")
        if self.expert_store not in ("host", "disk"):
            raise ValueError(f"expert_store must be host or disk, got {self.expert_store!r}")
        if self.expert_store != "host" and not self.expert_cache:
            raise ValueError(
                f"--expert-store {self.expert_store} places the experts --expert-cache does not keep: give --expert-cache N"
            )
        if self.device not in ("cpu", "cuda", "mps") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu, cuda, cuda:N or mps, got {self.device!r}")
        if not isinstance(self.serving, ServingLimits):
            raise ValueError(f"serving must be a ServingLimits, got {type(self.serving).__name__}")
        for name in ("cache_tokens", "max_message_bytes", "max_concurrent_rpcs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.balance_margin < 0:
            raise ValueError(f"balance_margin must be >= 0, got {self.balance_margin}")
        if not 0 < self.max_cache_share <= 1:
            raise ValueError(f"max_cache_share must be in (0, 1], got {self.max_cache_share}")
        for name in ("update_period_s", "rebalance_period_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.throughput is not None and not 0 <= self.throughput <= MAX_THROUGHPUT:
            raise ValueError(f"throughput must be in [0, {MAX_THROUGHPUT:g}] tokens/s, got {self.throughput}")
        if self.update_period_s > max_update_period_s():
            raise ValueError(
                f"update_period_s must be at most {max_update_period_s():g} s, got {self.update_period_s:g}: "
                f"records live about twice the period, and the DHT refuses records of ours that live "
                f"longer than that allows"
            )
        if self.announce_host is not None and not re.fullmatch(r"[^\s:]+(:\d{1,5})?", self.announce_host):
            raise ValueError(f"announce_host must be HOST or HOST:PORT, got {self.announce_host!r}")
        if self.host in WILDCARD_HOSTS and self.announce_host is None:
            raise ValueError(
                f"a peer listening on every interface (host {self.host}) cannot announce that address: pass "
                f"--announce-host PUBLIC_IP (or a DNS name) to say where clients reach it"
            )
        if not 0 <= self.port <= 65535 or not 0 <= self.dht_port <= 65535:
            raise ValueError(f"ports must be in 0..65535, got port={self.port} dht_port={self.dht_port}")
