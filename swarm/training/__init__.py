"""Training groups: peers (or trainers) that update the same tensors together on hivemind's averaging.

- averaging: a group's progress records, all-reduce rounds, and state download for joiners
- recipe: the run's recipe (RunRecipe: optimizer, schedule, clipping, batch, dtype policy), the schedule and
  clipping as pure functions, and the recipe published, signed, in the DHT and adopted by every member
- optim: optimizers built from the recipe the same way by peers and trainers (no weight decay on norms, biases and
  embeddings), their state created up front
- settings: the recipe's flags and averaging timing, checked before anything heavy is imported

May import protocol, swarm.dht, swarm.trust and swarm's own helpers (runtime, paths, progress, extras).
"""
