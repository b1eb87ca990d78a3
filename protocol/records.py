"""DHT record schemas: what a peer announces per block, and the model index.

Keys: `"{prefix}.{block}"` -> subkey peer id -> ServerInfo; `MODEL_INDEX_KEY` -> subkey prefix -> ModelRecord.
Both are validated strictly when written and when read: a record that does not fit is an InvalidRecordError.
"""

from __future__ import annotations

import enum
import re
from typing import Any, Literal

import pydantic

from protocol.errors import InvalidRecordError

PROTOCOL_VERSION = "1"
MODEL_INDEX_KEY = "_swarmlm.models"
_PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,128}")
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{32,64}$"  # a libp2p peer id in base58
MAX_RELAYS = 4


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


class ServerInfo(_Record):
    """What a peer announces for each block it serves."""

    state: ServerState
    start_block: int = pydantic.Field(ge=0)
    end_block: int = pydantic.Field(gt=0)
    throughput: float = pydantic.Field(ge=0)  # tokens/s this peer can push through its whole span
    cache_tokens_left: int = pydantic.Field(ge=0)
    dtype: str
    version: str
    endpoint: str = pydantic.Field(pattern=r"^[^\s:]+:\d{1,5}$")  # gRPC "host:port"
    # how clients reach it: "direct" gRPC at `endpoint`, or "p2p": gRPC tunneled through libp2p streams of its DHT
    # node (swarm/tunnel.py), through one of `relays` (peer ids that forward streams to it) when it has any
    transport: Literal["direct", "p2p"] = "direct"
    relays: tuple[pydantic.constr(pattern=PEER_ID_PATTERN), ...] = pydantic.Field(default=(), max_length=MAX_RELAYS)
    relay: bool = False  # it forwards streams to peers behind NAT (swarm/relay.py)
    adapters: tuple[str, ...] = ()
    next_pings: dict[str, float] = {}  # peer id -> RTT in seconds, to peers serving the next blocks
    run_id: str = pydantic.Field(default="", pattern=r"^[A-Za-z0-9_-]{0,64}$")  # training run; "" when frozen
    epoch: int = pydantic.Field(default=0, ge=0)  # updates applied in that run
    samples: int = pydantic.Field(default=0, ge=0)  # samples accumulated towards the next update

    @pydantic.field_validator("state", mode="before")
    @classmethod
    def _state_from_int(cls, value: Any) -> ServerState:
        if isinstance(value, bool) or not isinstance(value, int) or value not in ServerState._value2member_map_:
            raise ValueError(f"state must be one of {[int(s) for s in ServerState]}, got {value!r}")
        return ServerState(value)

    @pydantic.field_validator("adapters", "relays", mode="before")
    @classmethod
    def _tuple_from_list(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value

    @pydantic.model_validator(mode="after")
    def _span_is_ordered(self) -> "ServerInfo":
        if self.end_block <= self.start_block:
            raise ValueError(f"empty span [{self.start_block}, {self.end_block})")
        return self

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        wire["state"] = int(self.state)
        wire["adapters"] = list(self.adapters)
        wire["relays"] = list(self.relays)
        return wire


class ModelRecord(_Record):
    """An entry of the model index: a model the swarm knows, by its DHT prefix."""

    num_blocks: int = pydantic.Field(gt=0)
    repository: str


class TrainingProgress(_Record):
    """What a member of a training group publishes, often, so that the group knows when to update."""

    epoch: int = pydantic.Field(ge=0)
    samples: int = pydantic.Field(ge=0)


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
