"""Swarm mechanics shared by peers and clients.

- dht: starting and stopping hivemind DHT nodes (loopback by default, no NAT probing)
- identity: a node's key (its libp2p identity), which signs its records and names their owner
- validators: the DHT-level check of our records (lifetime cap, schema), next to the signature check
- tunnel: gRPC through libp2p streams, for peers that cannot be connected to
- relay: relays that forward those streams to peers behind NAT
- reachability: asking neighbours whether they can connect to a peer
- directory: reading/writing block records and the model index
- snapshot: SwarmSnapshot, the input of placement and routing decisions
- placement: which blocks a peer should serve (pure functions)
- averaging: training groups on hivemind's all-reduce (progress, rounds, joining)
- optim: optimizers built the same way by peers and trainers
- swarmkey: key files of private swarms; dhtauth and rpcauth: how the key gates the DHT and every gRPC call
- settings: optimizer names and averaging timing, checked before anything heavy is imported
- checkpoint: reading a checkpoint's config and selected tensors
- default_model: the built-in default model, converted once from a shipped GGUF file
- extras: which optional extras (bench, api) are installed, checked before slow work
- progress: progress bars, drawn only on a terminal
- bootstrap, status, cli: the `swarmlm bootstrap`, `swarmlm status` and `swarmlm` commands

Exports load on first use, so `swarmlm --help` does not pay for torch and hivemind.
"""

from protocol.lazy import lazy_exports

_EXPORTS = {
    "AveragingSettings": "swarm.settings",
    "SwarmKey": "swarm.swarmkey",
    "SwarmSnapshot": "swarm.snapshot",
    "TrainingGroup": "swarm.averaging",
    "announce": "swarm.directory",
    "choose_span": "swarm.placement",
    "fetch_models": "swarm.directory",
    "fetch_snapshot": "swarm.directory",
    "load_config": "swarm.checkpoint",
    "load_tensors": "swarm.checkpoint",
    "make_optimizer": "swarm.optim",
    "resolve_model_path": "swarm.checkpoint",
    "should_move": "swarm.placement",
    "start_dht": "swarm.dht",
    "stop_dht": "swarm.dht",
    "visible_maddrs": "swarm.dht",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("swarm", {name: (module, name) for name, module in _EXPORTS.items()})
