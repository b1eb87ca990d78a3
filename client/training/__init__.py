"""Training with the swarm: the trainer, its local reference, data, export and `swarmlm train`.

- trainer: SwarmTrainer, pipelined synchronous training with the peers of a run
- microbatches: a step's micro-batches through one member per stage, each added once, fenced members' moved
- stages, ledger, update: the run's stage members, where each micro-batch went, and the commit and apply of an update
- cotrainers: CoTrainers, meeting the run's other trainers and averaging the trainers' own parts with them
- syncs: TrainerSyncs, a trainer's outer optimizer and syncs with local steps (DiLoCo), waited for or overlapped
- local: LocalTrainer, the same training in one process (the reference the swarm is checked against)
- documents, stream, data: training batches from text, JSON lines or Parquet files (default: Shakespeare),
  streamed, a data shard per trainer, shuffled in windows, resumable exactly, prefetched (data's docstring)
- export: `swarmlm export`, the swarm's current weights as a Hugging Face checkpoint
- adapters: `swarmlm export --adapter-only`, a LoRA run's adapters as a peft adapter folder
- cli: `swarmlm train`

May import protocol, swarm and the client's core (model, sequence, config, ...); not client.demo or client.api.
"""
