#!/usr/bin/env bash
# Prepare a run of the bench on a lent GPU machine (see docs/testing.md#on-a-gpu-machine).
# That machine has python 3.12 with CUDA torch, numpy, scipy and tokenizers but not this project's other
# dependencies, and reaches no package index: so this downloads their wheels into .whl/ (about
# 52 MB: what travels is capped at 64 MB) and writes the default model's config and tokenizer
# into .devrun/smollm2 (its 98 MB GGUF does not fit; run.sh gives it random weights there).
# Then, with the device tool: run `bash .ci/device/run.sh` carrying [".whl", ".devrun"].
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP=".venv/bin/pip"
mkdir -p .whl .devrun
PLATFORM="--python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64"
# every runtime dependency that machine lacks, listed by hand: resolving them
# with pip would download a CUDA torch of several GB
$PIP download -q -d .whl --no-deps --only-binary=:all: $PLATFORM \
    hivemind transformers huggingface_hub safetensors accelerate peft kernels \
    grpcio protobuf cryptography cffi pycparser pydantic pydantic_core annotated-types typing-inspection \
    typing_extensions base58 ConfigArgParse netaddr py-multihash blake3 mmh3 morphys six py-cid \
    py-multibase py-multicodec msgpack sortedcontainers pyyaml idna packaging psutil uvloop tqdm \
    fastapi starlette uvicorn h11 click anyio sniffio annotated-doc opentelemetry-api prometheus_client \
    httpx2 httpcore2 tomlkit truststore
# these three publish only source archives: build their (pure Python) wheels here
$PIP wheel -q -w .whl --no-deps prefetch_generator varint python-baseconv
# the default model's config and tokenizer, from its converted copy (made on first use here)
.venv/bin/python - <<'PY'
import shutil
from pathlib import Path

from swarm.models.default_model import resolve_default_model
from swarm.paths import default_cache_dir

folder = resolve_default_model(default_cache_dir())
out = Path(".devrun/smollm2")
out.mkdir(parents=True, exist_ok=True)
for f in folder.iterdir():
    if f.is_file() and f.suffix not in (".safetensors", ".gguf") and not f.name.endswith(".index.json"):
        shutil.copy(f, out / f.name)
print("config and tokenizer of", folder.name, "in", out)
PY
du -sh .whl
