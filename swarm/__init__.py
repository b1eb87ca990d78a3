"""Swarm mechanics shared by peers and clients.

- dht: starting hivemind DHT nodes (loopback by default, no NAT probing)
- directory: reading/writing block records and the model index
- snapshot: SwarmSnapshot, the input of placement and routing decisions
- placement: which blocks a peer should serve (pure functions)
- checkpoint: reading a checkpoint's config and selected tensors
- default_model: the built-in default model, converted once from a shipped GGUF file
- bootstrap, status, cli: the `swarmlm bootstrap`, `swarmlm status` and `swarmlm` commands
"""

from swarm.checkpoint import load_config, load_tensors, resolve_model_path
from swarm.dht import start_dht, visible_maddrs
from swarm.directory import announce, fetch_models, fetch_snapshot
from swarm.placement import choose_span, should_move
from swarm.snapshot import SwarmSnapshot

__all__ = [
    "SwarmSnapshot",
    "announce",
    "choose_span",
    "fetch_models",
    "fetch_snapshot",
    "load_config",
    "load_tensors",
    "resolve_model_path",
    "should_move",
    "start_dht",
    "visible_maddrs",
]
