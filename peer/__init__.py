"""The peer daemon.

- config: PeerConfig, what `swarmlm peer` flags map onto
- server: PeerServer lifecycle (DHT, block choice, gRPC, announcing)
- blocks: loading a span of decoder layers from a checkpoint and running it
- handler: the gRPC methods (forward, backward, inference stream, info)
- cache: the KV-cache token budget
- validation: checks that turn bad input into typed errors
- throughput: measuring and caching the peer's speed
- cli: `swarmlm peer`
"""

from peer.blocks import BlockSpan, load_span
from peer.config import PeerConfig
from peer.server import PeerServer

__all__ = ["BlockSpan", "PeerConfig", "PeerServer", "load_span"]
