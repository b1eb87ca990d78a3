"""A peft LoRA adapter folder, as peers serve it and clients pick it: its identity, and what it replaces whole.

A folder is adapter_config.json beside adapter_model.safetensors (`PeftModel.save_pretrained`, `swarmlm export
--adapter-only`). Its digest names exactly those bytes, so that a client routes only through peers serving the same
adapter. Tensors it saves whole (peft's `modules_to_save`: embeddings, final norm, head) are the client's part.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where peft puts the base model's names in a saved adapter


def adapter_files(path: str | Path, name: str) -> tuple[Path, Path]:
    """The config and weights files of the adapter folder `path` (served or used as `name`).

    Raises:
        ValueError: the folder lacks either.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"adapter {name}: {path} is not a peft adapter folder (it needs {CONFIG_FILE} and {WEIGHTS_FILE}; "
            f"save one with PeftModel.save_pretrained or swarmlm export --adapter-only)"
        )
    return config_file, weights_file


def folder_digest(path: str | Path, name: str = "", weights: bytes | None = None) -> str:
    """16 hex digits of the SHA-256 of the folder's config and weights files: the same folder, the same digest.
    `weights`: the weights file's bytes, when the caller has read them already."""
    config_file, weights_file = adapter_files(path, name or str(path))
    digest = hashlib.sha256(config_file.read_bytes())
    digest.update(weights if weights is not None else weights_file.read_bytes())
    return digest.hexdigest()[:16]


def whole_modules(path: str | Path, name: str = "") -> dict[str, torch.Tensor]:
    """The tensors the adapter replaces whole, by checkpoint name (`lm_head.weight`, `model.norm.weight`)."""
    _, weights_file = adapter_files(path, name or str(path))
    return {
        key.removeprefix(PEFT_PREFIX): tensor for key, tensor in load_file(weights_file).items() if ".lora_" not in key
    }
