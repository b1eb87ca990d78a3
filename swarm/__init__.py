"""Swarm mechanics shared by peers and clients: the control plane, trust, transport, training groups, model files.

- dht/: DHT nodes, record validators, the directory of who serves what, snapshots, the swarm as JSON
- trust/: node keys and identity proofs, swarm keys, and how a private swarm gates the DHT, gRPC and averaging
- net/: gRPC through libp2p streams, relays, reachability probes
- training/: training groups on hivemind's all-reduce, optimizers, training settings
- models/: reading a checkpoint piecemeal, the built-in default model
- placement: which blocks a peer should serve (pure functions over a snapshot)
- bootstrap, status, cli: the `swarmlm bootstrap`, `swarmlm status` and `swarmlm` commands
- runtime, paths, extras, progress: helpers every role uses (async main and timeouts, the cache folder, optional
  extras, progress bars); they import nothing of swarm

Imports inside swarm run helpers <- {trust, models} <- {dht, net} <- training <- the commands; each subpackage's
docstring says what it may import, and tests/test_layout.py checks it. Exports load on first use, so
`swarmlm --help` does not pay for torch and hivemind.
"""

from protocol.lazy import lazy_exports

_EXPORTS = {
    "AveragingSettings": "swarm.training.settings",
    "SwarmKey": "swarm.trust.swarmkey",
    "SwarmSnapshot": "swarm.dht.snapshot",
    "GroupMember": "swarm.training.group",
    "announce": "swarm.dht.directory",
    "choose_span": "swarm.placement",
    "fetch_models": "swarm.dht.directory",
    "fetch_snapshot": "swarm.dht.directory",
    "load_config": "swarm.models.checkpoint",
    "load_tensors": "swarm.models.checkpoint",
    "make_optimizer": "swarm.training.optim",
    "resolve_model_path": "swarm.models.checkpoint",
    "should_move": "swarm.placement",
    "start_dht": "swarm.dht.node",
    "stop_dht": "swarm.dht.node",
    "visible_maddrs": "swarm.dht.node",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports("swarm", {name: (module, name) for name, module in _EXPORTS.items()})
