"""DHT record schemas: what a peer announces per block, and the model index.

Keys: `"{prefix}.{block}"` -> subkey peer id -> ServerInfo; `MODEL_INDEX_KEY` -> subkey prefix -> ModelRecord.
Both are validated strictly when written and when read: a record that does not fit is an InvalidRecordError.
Every number is finite and capped and every string bounded, so that a record's size and its weight in placement
and routing are bounded whatever a peer puts in it. The block records' subkeys carry their owner's key and their
lifetimes are capped (swarm/trust/identity.py, swarm/dht/validators.py).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Literal

import pydantic

from protocol.errors import InvalidRecordError

PROTOCOL_VERSION = "2"  # 2: peers push inference steps on to the next peer (InferenceStep.next)
MODEL_INDEX_KEY = "_swarmlm.models"
_PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{32,64}$"  # a libp2p peer id in base58
MAX_RELAYS = 4
MAX_THROUGHPUT = 1e7  # tokens/s; far above any span on one machine today
MAX_CACHE_TOKENS = 1 << 32
MAX_COUNT = 1 << 48  # epochs, samples
MAX_NUM_BLOCKS = 10_000
MAX_DECIDED_ROUNDS = 256  # stages of one run named in a trainer's decision: within the DHT's 8 KiB per value
ROUND_TAG_CHARS = 16  # of a round id (hex sha256), as a trainer's decision names it
DTYPES = ("float32", "float16", "bfloat16")
MAX_RECORD_TTL_S = 300.0
"""The DHT refuses records of ours that expire further ahead than this (swarm/dht/validators.py), so a record pinned
far into the future cannot outlive the announcements that should replace it."""
CLOCK_SKEW_S = 60.0
"""How far apart the clocks of honest nodes may be: their records must live at most MAX_RECORD_TTL_S minus this."""
MAX_JOINING_S = 600.0
"""A JOINING record counts as coverage this long after its joined_at (loading a big span takes minutes), and not
after: otherwise a peer that never finishes joining (or lies) would keep newcomers off its blocks forever."""


_PeerId = pydantic.constr(pattern=PEER_ID_PATTERN)


_RETIRED_FIELDS = ("adapters", "next_pings")  # an empty "adapters" is what version 2 always sent
MAX_ADAPTERS = 16
DEFAULT_MAX_REQUEST_TOKENS = 8192  # a peer's caps on one request when its record names none (peer/admission.py)
DEFAULT_MAX_ATTENTION_COST = 1 << 26
ADAPTER_NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"


class ServerState(enum.IntEnum):
    OFFLINE = 0
    JOINING = 1
    ONLINE = 2


class _Record(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True, frozen=True)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="python")

    @classmethod
    def from_wire(cls, raw: Any):
        try:
            return cls.model_validate(raw)
        except pydantic.ValidationError as exc:
            raise InvalidRecordError(f"invalid {cls.__name__} record: {exc.errors(include_url=False)}") from exc


class AdapterInfo(_Record):
    """A named LoRA adapter a peer serves for its blocks (`swarmlm peer --adapters NAME=DIR`, peer/adapters.py)."""

    name: str = pydantic.Field(pattern=f"^{ADAPTER_NAME_PATTERN}$")
    digest: str = pydantic.Field(pattern=r"^[0-9a-f]{16}$")  # of its folder's files: the same folder, the same digest
    client_modules: bool = False  # it also replaces embeddings, norm or head, which the client applies from the folder


class ServerInfo(_Record):
    """What a peer announces for each block it serves."""

    state: ServerState
    start_block: int = pydantic.Field(ge=0)
    end_block: int = pydantic.Field(gt=0)
    throughput: float = pydantic.Field(ge=0, le=MAX_THROUGHPUT, allow_inf_nan=False)  # tokens/s through the span
    cache_tokens_left: int = pydantic.Field(ge=0, le=MAX_CACHE_TOKENS)
    dtype: Literal[DTYPES]
    version: str = pydantic.Field(pattern=r"^[A-Za-z0-9.+-]{1,32}$")
    endpoint: str = pydantic.Field(pattern=r"^[^\s:]{1,253}:\d{1,5}$")  # gRPC "host:port"
    # how clients reach it: "direct" gRPC at `endpoint`, or "p2p": gRPC tunneled through libp2p streams of its DHT
    # node (swarm/net/tunnel.py), through one of `relays` (peer ids that forward streams to it) when it has any
    transport: Literal["direct", "p2p"] = "direct"
    relays: tuple[_PeerId, ...] = pydantic.Field(default=(), max_length=MAX_RELAYS)
    relay: bool = False  # it forwards streams to peers behind NAT (swarm/net/relay.py)
    run_id: str = pydantic.Field(default="", pattern=r"^[A-Za-z0-9_-]{0,64}$")  # training run; "" when frozen
    epoch: int = pydantic.Field(default=0, ge=0, le=MAX_COUNT)  # updates applied in that run
    samples: int = pydantic.Field(default=0, ge=0, le=MAX_COUNT)  # samples accumulated towards the next update
    # DHT time when the peer began joining this span: a JOINING record counts as coverage for MAX_JOINING_S after it
    joined_at: float = pydantic.Field(default=0.0, ge=0, allow_inf_nan=False)
    # how it holds its linear weights (peer/quantize.py); left out of the record when "none", so that clients that
    # predate it read unquantized peers' records as before and refuse quantized ones
    quantization: Literal["none", "int8", "nf4"] = "none"
    # named adapters a client may pick per session; left out of the record when empty, as quantization is. Peers
    # of version 2 and older announced an always empty list under this name, which still reads as none.
    adapters: tuple[AdapterInfo, ...] = pydantic.Field(default=(), max_length=MAX_ADAPTERS)
    # its caps on one request (batch x new tokens; that times the tokens attended), so that clients split what
    # would exceed them; left out of the record at their defaults, as quantization is
    max_request_tokens: int = pydantic.Field(default=DEFAULT_MAX_REQUEST_TOKENS, ge=1, le=MAX_CACHE_TOKENS)
    max_attention_cost: int = pydantic.Field(default=DEFAULT_MAX_ATTENTION_COST, ge=1, le=MAX_COUNT)

    @pydantic.field_validator("state", mode="before")
    @classmethod
    def _state_from_int(cls, value: Any) -> ServerState:
        if isinstance(value, bool) or not isinstance(value, int) or value not in ServerState._value2member_map_:
            raise ValueError(f"state must be one of {[int(s) for s in ServerState]}, got {value!r}")
        return ServerState(value)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _drop_unused_fields(cls, value: Any) -> Any:
        """Peers of version 2 and older announced `adapters` and `next_pings`, always empty, and nothing read them;
        their records stay valid without them (an empty `adapters` reads as none), and a non-empty `next_pings` is
        an unknown field."""
        if isinstance(value, dict) and any(value.get(name) in ([], (), {}) for name in _RETIRED_FIELDS):
            value = {k: v for k, v in value.items() if not (k in _RETIRED_FIELDS and v in ([], (), {}))}
        return value

    @pydantic.field_validator("relays", "adapters", mode="before")
    @classmethod
    def _tuple_from_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @pydantic.model_validator(mode="after")
    def _adapter_names_differ(self) -> ServerInfo:
        names = [adapter.name for adapter in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names repeat: {names}")
        return self

    @pydantic.model_validator(mode="after")
    def _span_is_ordered(self) -> ServerInfo:
        if self.end_block <= self.start_block:
            raise ValueError(f"empty span [{self.start_block}, {self.end_block})")
        return self

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        wire["state"] = int(self.state)
        wire["relays"] = list(self.relays)
        if self.quantization == "none":
            del wire["quantization"]
        if self.adapters:
            wire["adapters"] = [adapter.to_wire() for adapter in self.adapters]
        else:
            del wire["adapters"]
        for name, default in (
            ("max_request_tokens", DEFAULT_MAX_REQUEST_TOKENS),
            ("max_attention_cost", DEFAULT_MAX_ATTENTION_COST),
        ):
            if wire[name] == default:
                del wire[name]
        return wire


class ModelRecord(_Record):
    """An entry of the model index: a model the swarm knows, by its DHT prefix."""

    num_blocks: int = pydantic.Field(gt=0, le=MAX_NUM_BLOCKS)
    repository: str = pydantic.Field(pattern=r"^[^\x00-\x1f\x7f]{1,512}$")  # shown to operators only


class ModelIndexEntry(_Record):
    """What a peer stores in the model index (MODEL_INDEX_KEY) under its signed subkey: the model it serves, by DHT
    prefix. Readers count entries per prefix (swarm/dht/directory.py: fetch_models)."""

    prefix: str = pydantic.Field(pattern=rf"^{_PREFIX_PATTERN.pattern}$")
    num_blocks: int = pydantic.Field(gt=0, le=MAX_NUM_BLOCKS)
    repository: str = pydantic.Field(pattern=r"^[^\x00-\x1f\x7f]{1,512}$")


class TrainingProgress(_Record):
    """What a member of a training group publishes, often, under its signed subkey (swarm/training/members.py): where
    it stands, so that the group knows when to update and a member that fell behind knows which state a majority
    vouches for (swarm/training/state.py)."""

    epoch: int = pydantic.Field(ge=0, le=MAX_COUNT)  # updates applied
    samples: int = pydantic.Field(ge=0, le=MAX_COUNT)  # samples accumulated towards the next update
    # sha256 (hex) of its trainable state (parameters and optimizer statistics) after its update `epoch`; "" when it
    # vouches for none (it is joining, or its last round failed)
    param_digest: str = pydantic.Field(default="", pattern=r"^(?:[0-9a-f]{64})?$")
    # a round of update `epoch` that members agree on before applying it (the trainers' own, or a stage's outer sync:
    # swarm/training/agreement.py): its try number, the same for all, and its outcome here: the digest of what it
    # averaged, "x" when it failed here, "" before it ends
    round: int = pydantic.Field(default=0, ge=0, le=MAX_COUNT)
    round_digest: str = pydantic.Field(default="", pattern=r"^(?:[0-9a-f]{64}|x)?$")
    # the same for an overlapped sync (`--sync-overlap`), which goes on while the member is at later updates, beside
    # its round of those: the update it was taken after (-1: none yet), its try number and outcome here
    sync_update: int = pydantic.Field(default=-1, ge=-1, le=MAX_COUNT)
    sync_round: int = pydantic.Field(default=0, ge=0, le=MAX_COUNT)
    sync_digest: str = pydantic.Field(default="", pattern=r"^(?:[0-9a-f]{64}|x)?$")
    # it stopped cleanly: from now on it vouches for no state and joins no update (swarm/training/members.py)
    left: bool = False
    # a trainer's decision on update `epoch`, stored before its first Apply: the rounds it applies (the first 16 hex
    # of each stage's round id) and their clipping factor, so that a stage whose Apply never came (the trainer died
    # between its Apply calls) applies the same update once the trainer is gone (peer/training/decision.py)
    decided: tuple[pydantic.constr(pattern=rf"^[0-9a-f]{{{ROUND_TAG_CHARS}}}$"), ...] = pydantic.Field(
        default=(), max_length=MAX_DECIDED_ROUNDS
    )
    clip_scale: float = pydantic.Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)

    @pydantic.field_validator("decided", mode="before")
    @classmethod
    def _tuple_from_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @pydantic.model_validator(mode="after")
    def _decided_with_a_scale(self) -> TrainingProgress:
        if self.decided and not self.clip_scale > 0:
            raise ValueError(f"a decision needs a clip_scale in (0, 1], got {self.clip_scale}")
        return self

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        if not self.decided:  # what every record but a trainer's just before Apply holds: read by older versions too
            del wire["decided"], wire["clip_scale"]
        else:
            wire["decided"] = list(self.decided)
        if self.sync_update < 0:  # the same: only runs with overlapped syncs publish them
            del wire["sync_update"], wire["sync_round"], wire["sync_digest"]
        return wire


def record_ttl_s(update_period_s: float) -> float:
    """How long a peer's records live: two announcement periods and a little, so one lost announcement is no gap."""
    return 2 * update_period_s + 5


def max_update_period_s() -> float:
    """The longest announcement period whose records the DHT still accepts from a node with a skewed clock."""
    return (MAX_RECORD_TTL_S - CLOCK_SKEW_S - 5) / 2


def round_tag(round_id: str) -> str:
    """How a trainer's decision names a round (TrainingProgress.decided)."""
    return round_id[:ROUND_TAG_CHARS]


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.{block}"


def check_run_id(run_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return run_id


def check_prefix(prefix: str) -> str:
    if not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"DHT prefix {prefix!r} must be 1-128 characters of letters, digits, '_' or '-'")
    return prefix


def prefix_for_model(model: str) -> str:
    """The DHT prefix of a model: the last part of its path or hub id, with other characters turned into '-'.

    Peers and clients apply the same rule, so `swarmlm peer ./SmolLM2-135M` and a client given
    `HuggingFaceTB/SmolLM2-135M` meet under "SmolLM2-135M".
    """
    name = model.rstrip("/\\").replace("\\", "/").split("/")[-1]
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:128]
    if not cleaned:
        raise ValueError(f"cannot derive a DHT prefix from model {model!r}; pass one explicitly")
    return cleaned
