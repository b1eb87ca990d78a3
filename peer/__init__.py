"""The peer daemon.

- cli: `swarmlm peer`
- config: PeerConfig (with its ServingLimits), what `swarmlm peer` flags map onto
- server: PeerServer lifecycle (DHT, block choice, gRPC, announcing)
- reach: how clients reach the peer (direct gRPC, or libp2p through a relay from behind NAT)
- handler: the gRPC service; its unary calls (forward, backward, info, state)
- inference: the inference stream (sessions, steps pushed into them by the previous peer)
- steps: one step of a session, checked against its cache, then batched with others or computed in chunks
- inbox: the kinds of work a session's inbox holds, and the reader of the client's requests
- served: the span served now, and what every request goes through (span check, validation, compute thread)
- validation: checks that turn bad input into typed errors
- admission: caps on one request and on the work waiting for compute
- compute: the one compute thread, inference steps ahead of training work
- batching: one forward for the decode steps of concurrent sessions
- forwarding: pushing a step's output on to the next peer of the client's route
- activations: forward activations kept for their backward
- cache: the KV-cache token budget
- timings: where inference steps spend their time (phase timers, reported by Info)
- blocks: loading a span of decoder layers from a checkpoint and running it
- quantize, offload, capacity: int8/nf4 weights, blocks streamed beyond a memory budget, how many blocks fit at
  each setting (`--quantize auto`)
- experts: MoE experts kept on the device N a layer, the rest in host memory (`--expert-cache`)
- adapters: named LoRA adapters served beside the weights, chosen per request (`--adapters`)
- throughput: measuring and caching the peer's speed
- training: a training peer's optimizer, gradient accumulation and group updates (`--train`)
- lora: LoRA adapters for a span (`--train-mode lora`), and checkpoint-named weights for export
"""

from protocol.lazy import lazy_exports

# name -> (module, attribute): loaded on first use, so that parsing a command's arguments stays light
_EXPORTS = {
    "BlockSpan": ("peer.blocks", "BlockSpan"),
    "PeerConfig": ("peer.config", "PeerConfig"),
    "PeerServer": ("peer.server", "PeerServer"),
    "SpanTraining": ("peer.training.span", "SpanTraining"),
    "TrainingConfig": ("peer.config", "TrainingConfig"),
    "load_span": ("peer.blocks", "load_span"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("peer", _EXPORTS)
