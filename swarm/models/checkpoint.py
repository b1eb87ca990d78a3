"""Read a Hugging Face checkpoint piecemeal: its config, and only the tensors a peer or client needs."""

from __future__ import annotations

import copy
import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from protocol.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def resolve_model_path(model: str) -> Path:
    """A local checkpoint folder, or a hub id already in the local Hugging Face cache (nothing is downloaded)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; pass a Hugging Face checkpoint folder")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file; pass a Hugging Face checkpoint folder")
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelNotFoundError(f"model folder {model!r} does not exist; pass a Hugging Face checkpoint folder")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # the hub raises several kinds for "not cached" and for bad ids
        raise ModelNotFoundError(
            f"model {model!r} is neither a local folder nor a hub id in the local cache; "
            f"download it first (e.g. `hf download {model}`) or pass a checkpoint folder"
        ) from None  # the hub's own chain of errors says nothing more useful


def load_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelNotFoundError(f"cannot read the config of {path}: {exc}") from exc


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ModelNotFoundError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors checkpoints are supported")


def _wanted_by_file(path: Path, wanted: Callable[[str], bool]) -> dict[Path, list[str]]:
    """The names that pass `wanted`, by the safetensors file holding them."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(path).items():
        if wanted(name):
            by_file.setdefault(file, []).append(name)
    return by_file


def load_tensors(
    path: Path, wanted: Callable[[str], bool], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Read just the tensors whose names pass `wanted`, shard by shard (the rest never enter memory)."""
    tensors = {}
    for file, names in _wanted_by_file(path, wanted).items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                tensors[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    return tensors


def tensor_shapes(path: Path, wanted: Callable[[str], bool]) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors whose names pass `wanted`, read from the files' headers (no tensor is loaded)."""
    shapes = {}
    for file, names in _wanted_by_file(path, wanted).items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the checkpoint declares ("auto" on both peers and clients), float32 if it declares none."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    return found if isinstance(found, torch.dtype) else torch.float32


def attention_for(config: PretrainedConfig) -> str:
    """The attention implementation peers and references compute with: sdpa, or the model's own eager attention
    where sdpa refuses the model (scores capped by `attn_logit_softcapping`, Gemma 2; a family without sdpa support,
    GPT-OSS with its attention sinks)."""
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    try:
        return "sdpa" if getattr(causal_lm_class(config), "_supports_sdpa", True) else "eager"
    except ModelNotFoundError:  # not a causal LM transformers knows: refused later, by whoever needs its classes
        return "sdpa"


def causal_lm_class(config: PretrainedConfig) -> type:
    """The family's causal LM class, as AutoModelForCausalLM picks it (LlamaForCausalLM for Llama)."""
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if causal_lm is None:
        raise ModelNotFoundError(f"model type {config.model_type!r} has no causal-LM class in transformers")
    return getattr(transformers, causal_lm)


def meta_causal_lm(config: PretrainedConfig) -> torch.nn.Module:
    """The family's causal LM built from `config` on the meta device, to read its layout (0.07 s for 80 layers):
    eager attention, which it never runs, so that families refusing sdpa build too."""
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return causal_lm_class(config)(config)


def family_class(config: PretrainedConfig, suffix: str) -> type:
    """A class of the model's transformers family by suffix: "DecoderLayer" gives LlamaDecoderLayer for Llama."""
    model_type = config.model_type
    causal_lm = causal_lm_class(config)
    family = causal_lm.__name__.removesuffix("ForCausalLM")
    # the class's own module: not always named after the model type (gemma3_text lives in models/gemma3)
    module = importlib.import_module(causal_lm.__module__)
    found = getattr(module, f"{family}{suffix}", None)
    if found is None:
        raise ModelNotFoundError(
            f"model type {model_type!r} is not supported: no {family}{suffix} in {module.__name__}"
        )
    return found
