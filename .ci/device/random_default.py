"""The default model's config and tokenizer (from .devrun/smollm2) with random weights, saved into a folder.

On a lent GPU machine only: the real GGUF does not fit what travels there, and the bench measures
speed, which random weights of the same shapes show as well. Never point this at a machine's real
model cache.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src = Path(".devrun/smollm2")
dst = Path(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
dst.mkdir(parents=True, exist_ok=True)
model.save_pretrained(dst)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, dst / f.name)
print("random default model in", dst, sum(p.numel() for p in model.parameters()), "parameters")
