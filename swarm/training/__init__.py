"""Training groups: peers (or trainers) that update the same tensors together on hivemind's averaging.

- averaging: a group's progress records, all-reduce rounds, and state download for joiners
- optim: optimizers built the same way by peers and trainers, their state created up front
- settings: optimizer names and averaging timing, checked before anything heavy is imported

May import protocol, swarm.dht, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
