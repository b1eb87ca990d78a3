"""peft LoRA adapter folders for tests: made on the whole local model with random (non-zero) weights."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def save_random_adapter(
    model_path: str | Path,
    out: str | Path,
    *,
    seed: int,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"),
    rank: int = 4,
    layers: list[int] | None = None,
    modules_to_save: list[str] | None = None,
    std: float = 0.1,
) -> Path:
    """An adapter of the model at `model_path` whose A and B (and saved modules) are drawn from `seed`, saved by peft."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(target_modules),
        layers_to_transform=layers,
        modules_to_save=modules_to_save,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # the adapters, and the copies of modules_to_save
                param.add_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(str(out), save_embedding_layers=False)  # only what the adapter changes
    return Path(out)


def local_peft(model_path: str | Path, adapter: str | Path) -> PeftModel:
    """The reference: the whole model with the adapter, as peft computes it."""
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()
