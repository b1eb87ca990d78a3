"""The peer daemon.

- config: PeerConfig, what `swarmlm peer` flags map onto
- server: PeerServer lifecycle (DHT, block choice, gRPC, announcing)
- reach: how clients reach the peer (direct gRPC, or libp2p through a relay from behind NAT)
- blocks: loading a span of decoder layers from a checkpoint and running it
- handler: the gRPC methods (forward, backward, inference stream, info, state)
- timings: where inference steps spend their time (phase timers, reported by Info)
- training: a training peer's optimizer, gradient accumulation and group updates (`--train`)
- lora: LoRA adapters for a span (`--train-mode lora`), and checkpoint-named weights for export
- cache: the KV-cache token budget
- validation: checks that turn bad input into typed errors
- throughput: measuring and caching the peer's speed
- cli: `swarmlm peer`
"""

from protocol.lazy import lazy_exports

# name -> (module, attribute): loaded on first use, so that parsing a command's arguments stays light
_EXPORTS = {
    "BlockSpan": ("peer.blocks", "BlockSpan"),
    "PeerConfig": ("peer.config", "PeerConfig"),
    "PeerServer": ("peer.server", "PeerServer"),
    "SpanTraining": ("peer.training", "SpanTraining"),
    "TrainingConfig": ("peer.training", "TrainingConfig"),
    "load_span": ("peer.blocks", "load_span"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("peer", _EXPORTS)
