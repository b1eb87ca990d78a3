"""The control plane: hivemind DHT nodes and what swarmlm keeps in them.

- node: starting and stopping DHT nodes (loopback by default, nothing contacted unasked, records signed), and plain
  hivemind ones for bare averagers and tests
- addresses: the multiaddr a node announces for a public host (checked before anything heavy loads)
- validators: the DHT-level check of our records (signed subkeys only, lifetime and size caps, schema), next to
  the signature check
- ledger: the bound on what one node keeps (entries per key, bytes in all), counted by the validator
- directory: reading and writing block records and the model index
- snapshot: SwarmSnapshot, a point-in-time view of who serves what (the input of placement and routing)
- state: the swarm as one JSON document (`swarmlm status --json`, the monitor)

May import protocol, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
