"""Model files: reading a checkpoint piecemeal, and the built-in default model.

- checkpoint: a checkpoint's config, and only the tensors a peer or client needs
- adapters: a peft LoRA adapter folder: its digest, and the tensors it replaces whole (the client's part)
- default_model: SmolLM2-135M-Instruct, converted once from the GGUF file that ships in a package

May import protocol and swarm's own helpers (runtime, paths, progress, extras); nothing else of swarm.
"""
