"""Pure data shared by peers and clients.

- swarmlm.proto / swarmlm_pb2: wire messages and the gRPC service, version 1
- codec: torch tensors <-> protobuf Tensor; finite: the NaN/inf check both sides make on received tensors
- records: DHT record schemas (ServerInfo, ModelRecord, TrainingProgress) and key naming
- errors: the exception tree and its wire codes
- service: method table of the Peer service, derived from the .proto
- lazy: package exports loaded on first use (every package's `__getattr__`)
"""

from protocol.lazy import lazy_exports

# name -> (module, attribute): loaded on first use, so that parsing a command's arguments stays light
_EXPORTS = {
    "BadRequestError": ("protocol.errors", "BadRequestError"),
    "CacheFullError": ("protocol.errors", "CacheFullError"),
    "InternalError": ("protocol.errors", "InternalError"),
    "InvalidRecordError": ("protocol.errors", "InvalidRecordError"),
    "MODEL_INDEX_KEY": ("protocol.records", "MODEL_INDEX_KEY"),
    "MessageTooLargeError": ("protocol.errors", "MessageTooLargeError"),
    "ModelNotFoundError": ("protocol.errors", "ModelNotFoundError"),
    "ModelRecord": ("protocol.records", "ModelRecord"),
    "NoPeersError": ("protocol.errors", "NoPeersError"),
    "OverloadedError": ("protocol.errors", "OverloadedError"),
    "PROTOCOL_VERSION": ("protocol.records", "PROTOCOL_VERSION"),
    "PeerFaultError": ("protocol.errors", "PeerFaultError"),
    "PeerUnavailableError": ("protocol.errors", "PeerUnavailableError"),
    "SequenceTooLongError": ("protocol.errors", "SequenceTooLongError"),
    "ServerInfo": ("protocol.records", "ServerInfo"),
    "ServerState": ("protocol.records", "ServerState"),
    "StaleEpochError": ("protocol.errors", "StaleEpochError"),
    "RecipeMismatchError": ("protocol.errors", "RecipeMismatchError"),
    "StateDownloadError": ("protocol.errors", "StateDownloadError"),
    "TrainingFaultError": ("protocol.errors", "TrainingFaultError"),
    "SwarmError": ("protocol.errors", "SwarmError"),
    "UnauthorizedError": ("protocol.errors", "UnauthorizedError"),
    "UnknownSessionError": ("protocol.errors", "UnknownSessionError"),
    "WrongSpanError": ("protocol.errors", "WrongSpanError"),
    "block_key": ("protocol.records", "block_key"),
    "decode_tensor": ("protocol.codec", "decode_tensor"),
    "encode_tensor": ("protocol.codec", "encode_tensor"),
    "error_from_code": ("protocol.errors", "error_from_code"),
    "pb": ("protocol.swarmlm_pb2", None),  # the module itself
    "prefix_for_model": ("protocol.records", "prefix_for_model"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("protocol", _EXPORTS)
