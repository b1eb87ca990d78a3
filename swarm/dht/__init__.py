"""The control plane: hivemind DHT nodes and what swarmlm keeps in them.

- node: starting and stopping DHT nodes (loopback by default, nothing contacted unasked, records signed)
- addresses: the multiaddr a node announces for a public host (checked before anything heavy loads)
- validators: the DHT-level check of our records (lifetime cap, schema), next to the signature check
- directory: reading and writing block records and the model index
- snapshot: SwarmSnapshot, a point-in-time view of who serves what (the input of placement and routing)
- state: the swarm as one JSON document (`swarmlm status --json`, the monitor)

May import protocol, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
