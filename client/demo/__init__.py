"""`swarmlm demo`: a whole swarm on this machine, started, used and stopped by one command.

- cli: the command; one chat with the built-in model by default
- api: `--api`, the same swarm served through the OpenAI-compatible API and the monitor until Ctrl+C
- train: `--train`, the same swarm fine-tuned on Shakespeare
- local_swarm: LocalSwarm, the bootstrap and peer processes of the demo (and of the benchmarks), always reaped

May import protocol, swarm and the rest of client.
"""
