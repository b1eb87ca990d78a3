"""Pure data shared by peers and clients.

- swarmlm.proto / swarmlm_pb2: wire messages and the gRPC service, version 1
- codec: torch tensors <-> protobuf Tensor
- records: DHT record schemas (ServerInfo, ModelRecord, TrainingProgress) and key naming
- errors: the exception tree and its wire codes
- service: method table of the Peer service, derived from the .proto
"""

from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    InternalError,
    InvalidRecordError,
    MessageTooLargeError,
    ModelNotFoundError,
    NoPeersError,
    PeerUnavailableError,
    SequenceTooLongError,
    StaleEpochError,
    StateDownloadError,
    SwarmError,
    UnknownSessionError,
    WrongSpanError,
    error_from_code,
)
from protocol.records import (
    MODEL_INDEX_KEY,
    PROTOCOL_VERSION,
    ModelRecord,
    ServerInfo,
    ServerState,
    block_key,
    prefix_for_model,
)

__all__ = [
    "MODEL_INDEX_KEY",
    "PROTOCOL_VERSION",
    "BadRequestError",
    "CacheFullError",
    "InternalError",
    "InvalidRecordError",
    "MessageTooLargeError",
    "ModelNotFoundError",
    "ModelRecord",
    "NoPeersError",
    "PeerUnavailableError",
    "SequenceTooLongError",
    "StaleEpochError",
    "StateDownloadError",
    "ServerInfo",
    "ServerState",
    "SwarmError",
    "UnknownSessionError",
    "WrongSpanError",
    "block_key",
    "decode_tensor",
    "encode_tensor",
    "error_from_code",
    "pb",
    "prefix_for_model",
]
