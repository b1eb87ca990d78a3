"""The client library: use a swarm-served model like a local transformers model.

The core (top-level modules):
- model: DistributedModelForCausalLM / AutoDistributedModelForCausalLM (local embeddings, norm, head)
- sequence: the remote blocks: routes on a cached directory, forward/backward with autograd, spot checks drawn;
  hops: what its calls carry and keep (hop records, training tags); hop_checks: its spot checks, run
- splitting: requests cut to the caps peers announce; adapters: the peers serving the named LoRA adapter asked for
- session: inference sessions with server-side KV caches, steps pushed peer to peer, failover by replay
- retry: what a peer's failure costs a request (blame, ban, re-route, back-off), for sequence and session alike
- bans: BanList, the peers to avoid for now; dialing: Dialer, each peer's address and round trip, its key proved
- decoding: one generation per thread, token by token (what `swarmlm api` runs); heads: the LM heads of
  concurrent generations as one batch (optionally in lockstep)
- routing: route planning (pure functions)
- transport: gRPC channels (a bounded pool) and calls; loop: the background event loop
- checks: the caller's input before sending, every peer's answer before use, whose fault a peer's error is
- verify: spot checks, a share of hops recomputed on other peers; a peer outvoted two to one is banned
- config: ClientConfig, TrainConfig

Rooms built on the core (each may import the core, never the other way round):
- training/: SwarmTrainer, its local reference, data, `swarmlm train` and `swarmlm export`
- api/: `swarmlm api`, the OpenAI-compatible server
- monitor/: `swarmlm monitor`, the live web page
- demo/: `swarmlm demo`, a whole swarm on this machine (chat, --api, --train)
"""

from protocol.lazy import lazy_exports

# name -> (module, attribute): loaded on first use, so that parsing a command's arguments stays light
_EXPORTS = {
    "AutoDistributedModelForCausalLM": ("client.model", "AutoDistributedModelForCausalLM"),
    "ClientConfig": ("client.config", "ClientConfig"),
    "ClientSession": ("client.model", "ClientSession"),
    "DistributedModelForCausalLM": ("client.model", "DistributedModelForCausalLM"),
    "InferenceSession": ("client.session", "InferenceSession"),
    "RouteHop": ("client.routing", "RouteHop"),
    "StepResult": ("client.training.trainer", "StepResult"),
    "SwarmTrainer": ("client.training.trainer", "SwarmTrainer"),
    "TrainConfig": ("client.config", "TrainConfig"),
    "plan_forward_route": ("client.routing", "plan_forward_route"),
    "plan_inference_route": ("client.routing", "plan_inference_route"),
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("client", _EXPORTS)
