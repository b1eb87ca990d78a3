"""The peer daemon.

- config: PeerConfig, what `swarmlm peer` flags map onto
- server: PeerServer lifecycle (DHT, block choice, gRPC, announcing)
- reach: how clients reach the peer (direct gRPC, or libp2p through a relay from behind NAT)
- blocks: loading a span of decoder layers from a checkpoint and running it
- handler: the gRPC methods (forward, backward, inference stream, info, state)
- training: a training peer's optimizer, gradient accumulation and group updates (`--train`)
- lora: LoRA adapters for a span (`--train-mode lora`), and checkpoint-named weights for export
- cache: the KV-cache token budget
- validation: checks that turn bad input into typed errors
- throughput: measuring and caching the peer's speed
- cli: `swarmlm peer`
"""

from peer.blocks import BlockSpan, load_span
from peer.config import PeerConfig
from peer.training import SpanTraining, TrainingConfig
from peer.server import PeerServer

__all__ = ["BlockSpan", "PeerConfig", "PeerServer", "SpanTraining", "TrainingConfig", "load_span"]
