"""Training groups: peers (or trainers) that update the same tensors together on hivemind's averaging.

- group: GroupMember, one process's place in a group (a stage's peers, or a run's trainers): its progress, its
  rounds, copying the group's state
- rounds: all-reduce among the members a commit names, no matchmaking; allreduce: hivemind's runner with uniform
  weights, in-dtype sums and the faults it saw
- members: signed progress records, read back only when verified
- state: a state copied only when a strict majority of the group vouches for its digest
- process: bounded calls into averager processes; roundbench: a round against a bare hivemind averager
- recipe: the run's recipe (RunRecipe: optimizer, schedule, clipping, batch, dtype policy), the schedule and
  clipping as pure functions, and the recipe published, signed, in the DHT and adopted by every member
- adapters: LoRA adapters injected into decoder layers, initialized by block and layer name (the same on every
  member and in the local reference)
- optim: optimizers built from the recipe the same way by peers and trainers (no weight decay on norms, biases and
  embeddings), their state created up front
- settings: the recipe's flags and averaging timing, checked before anything heavy is imported

May import protocol, swarm.dht, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
