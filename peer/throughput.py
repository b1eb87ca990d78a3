"""A peer's compute throughput, measured once per way of computing its span (model shape, span length, dtype,
device, and how its weights are held: quantized, streamed, experts cached) and cached."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from peer.blocks import BlockSpan

logger = logging.getLogger(__name__)

_TOKENS = 64
_REPEATS = 3


def throughput_key(span: BlockSpan) -> str:
    """What a measured throughput holds for: spans that differ in any of it compute at other speeds."""
    config = span.config
    key = (
        f"{config.model_type}-h{config.hidden_size}-i{getattr(config, 'intermediate_size', 0)}"
        f"-n{span.end - span.start}-{str(span.dtype).removeprefix('torch.')}-{span.device}"
    )
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # the experts' number, choice and size set an MoE block's work as much as its hidden size
        key += (
            f"-e{experts}k{getattr(config, 'num_experts_per_tok', 0)}"
            f"m{getattr(config, 'moe_intermediate_size', 0)}s{getattr(config, 'shared_expert_intermediate_size', 0)}"
        )
    if span.quantization != "none":  # dequantizing each weight per forward costs time
        key += f"-{span.quantization}"
    if span.streamer is not None:  # loading streamed blocks costs time too
        key += f"-{type(span.streamer.store).__name__}-resident{span.streamer.resident}"
    caches = span.expert_caches
    if caches is not None:  # and so do experts loaded when picked
        key += f"-experts{caches.capacity}-{'disk' if caches.store is not None else 'host'}"
        key += "-prefetch" if caches.prefetching else ""
    return key


def measure_throughput(span: BlockSpan, cache_file: Path) -> float:
    """Tokens/s of a forward pass over the whole span (best of a few runs of a 64-token batch)."""
    device = span.device
    key = throughput_key(span)
    cached = _read(cache_file)
    if key in cached:
        return cached[key]
    hidden = torch.randn(1, _TOKENS, span.config.hidden_size, dtype=span.dtype, device=device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(_REPEATS):
            began = time.perf_counter()
            span(hidden)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # kernels run asynchronously: wait before reading the clock
            best = min(best, time.perf_counter() - began)
    throughput = _TOKENS / best
    cached[key] = throughput
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cached, indent=1))
    except OSError as exc:  # a read-only home must not stop a peer
        logger.warning("could not cache throughput in %s: %s", cache_file, exc)
    logger.info("measured throughput %.0f tokens/s for %s", throughput, key)
    return throughput


def _read(cache_file: Path) -> dict[str, float]:
    try:
        data = json.loads(cache_file.read_text())
        return {k: float(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError):
        return {}
