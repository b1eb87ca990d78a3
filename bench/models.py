"""The benchmark models: the built-in default model, and random-weight Llama configs saved once and reused.

Random models are built from a transformers config with a fixed seed and saved with `save_pretrained`
(safetensors) under the models folder; a `bench-spec.json` beside them says what they were built from, so a
changed spec is rebuilt instead of silently reused. Nothing is downloaded.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

from swarm.models.checkpoint import load_config
from swarm.models.default_model import resolve_default_model

logger = logging.getLogger(__name__)

_SEED = 0
_COMMON = dict(
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

RANDOM_SPECS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        **_COMMON,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        **_COMMON,
    ),
    # the blocks of an 8B-class Llama (GQA 32/8), for GPU runs
    "large": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        **_COMMON,
    ),
}
MODELS = ("default", *RANDOM_SPECS)
"""Names accepted by --configs."""


@dataclass(frozen=True)
class BenchModel:
    name: str
    path: Path
    config: PretrainedConfig
    description: str

    @property
    def num_blocks(self) -> int:
        return self.config.num_hidden_layers


def describe(config: PretrainedConfig) -> str:
    return (
        f"{config.model_type}, hidden {config.hidden_size}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads, vocab {config.vocab_size}"
    )


def _is_built(folder: Path, spec: dict) -> bool:
    marker = folder / "bench-spec.json"
    return marker.is_file() and json.loads(marker.read_text()) == spec and any(folder.glob("*.safetensors"))


def build_random(name: str, models_dir: Path, *, dtype: str = "float32", device: str = "cpu") -> Path:
    """Build (once) the random Llama `name` in `dtype` and return its folder."""
    spec = {"name": name, "seed": _SEED, "dtype": dtype, "config": RANDOM_SPECS[name]}
    folder = models_dir / f"{name}-{dtype}"
    if _is_built(folder, spec):
        return folder
    logger.info("building the random model %s (%s) in %s", name, dtype, folder)
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models_dir))
    try:
        torch.manual_seed(_SEED)
        build_device = device if device == "cuda" and torch.cuda.is_available() else "cpu"
        with torch.device(build_device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM_SPECS[name]), dtype=getattr(torch, dtype))
        model.save_pretrained(staging, safe_serialization=True)
        (staging / "bench-spec.json").write_text(json.dumps(spec, indent=1))
        del model
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve(name: str, *, models_dir: Path, cache_dir: Path, dtype: str, device: str) -> BenchModel:
    """The checkpoint folder and config of benchmark model `name`."""
    if name == "default":
        path = resolve_default_model(cache_dir)
        config = load_config(path)
        return BenchModel(name, path, config, f"{path.name} ({describe(config)})")
    if name not in RANDOM_SPECS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    # random weights are saved in float32 on CPU runs, in the compute dtype on GPU runs (smaller files)
    path = build_random(name, models_dir, dtype="float32" if device == "cpu" else dtype, device=device)
    config = load_config(path)
    return BenchModel(name, path, config, f"random {describe(config)}")


def load_reference(model: BenchModel, *, dtype: str, device: str) -> torch.nn.Module:
    """The whole model as a local Hugging Face model: same checkpoint folder, same dtype, same attention kernel."""
    reference = AutoModelForCausalLM.from_pretrained(
        model.path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return reference.to(device).eval()


def span_weight_bytes(reference: torch.nn.Module, start: int, end: int) -> int:
    """Bytes of the parameters of blocks [start, end) (what a peer serving them must hold)."""
    layers = reference.model.layers[start:end]
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def kv_bytes(config: PretrainedConfig, blocks: int, tokens: int, dtype: str) -> int:
    """KV-cache bytes of `tokens` tokens over `blocks` blocks."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (
        2
        * blocks
        * config.num_key_value_heads
        * head_dim
        * tokens
        * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    )
