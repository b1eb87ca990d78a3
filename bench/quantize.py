"""What quantized blocks save and cost: a model's whole span held unquantized, as int8 and as nf4
(peer/quantize.py, `swarmlm peer --quantize`), computed in this process as a peer computes it.

Per quantization: the bytes the span holds (parameters and buffers; its linear weights apart), a 128-token
prefill and a one-token decode step after it (medians over rounds that alternate the quantizations, so drift in
the machine's speed falls on all of them alike), the rounding of the linear weights (|rounded - weight| /
|weight|, Frobenius norms, mean over the weights), and the largest difference of the span's output from the
unquantized span's, relative to that output's largest value, on embeddings of random tokens. On the CPU the codes are widened back into the
compute dtype at every forward in plain torch, so the time is the price of the memory.

    python -m bench.quantize [--config tiny|small|default] [--rounds 5] [--device cpu|cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from bench import models
from bench.hop_profile import write_section
from peer.blocks import BlockSpan, load_span
from peer.quantize import QuantizedLinear
from protocol.vocab import Quantization
from swarm.models.checkpoint import load_tensors

FIGURE = Path(__file__).resolve().parent / "figures" / "quantize.md"
HEAD = """# Quantized blocks: memory and time

`python -m bench.quantize --config CONFIG --device DEVICE`: one section per config and device, replaced when rerun.
What each column is: the docstring of bench/quantize.py.
"""
PROMPT = 128
EMBEDDINGS = "model.embed_tokens.weight"


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held(span: BlockSpan) -> tuple[int, int]:
    """(bytes of the linear weights, bytes of everything else the span holds)."""
    linear = [m for m in span.modules() if type(m) is nn.Linear or isinstance(m, QuantizedLinear)]
    weights = sum(_bytes(m.buffers()) if isinstance(m, QuantizedLinear) else m.weight.numel() * m.weight.element_size()
                  for m in linear)  # fmt: skip
    return weights, _bytes(span.parameters()) + _bytes(span.buffers()) - weights


def timed(span: BlockSpan, hidden: torch.Tensor, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode-step seconds, prefill output)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    cache = span.new_cache()
    with torch.inference_mode():
        sync()
        began = time.perf_counter()
        out = span(hidden, cache=cache)
        sync()
        prefill = time.perf_counter() - began
        began = time.perf_counter()
        span(hidden[:, -1:], position_ids=torch.tensor([[PROMPT]], device=device), cache=cache, prefix_length=PROMPT)
        sync()
    return prefill, time.perf_counter() - began, out


def measure(model: models.BenchModel, rounds: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    config = model.config
    spans = {
        mode: load_span(model.path, config, 0, config.num_hidden_layers, dtype=dtype, device=device, quantization=mode)
        for mode in Quantization
    }
    # the input a first block sees: embeddings of random tokens (random hidden states blow up through the layers)
    (embeddings,) = load_tensors(model.path, lambda name: name == EMBEDDINGS, dtype=dtype).values()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    hidden = embeddings[ids].to(device)
    times = {mode: ([], []) for mode in Quantization}
    outputs = {}
    for span in spans.values():  # a warm-up of each
        timed(span, hidden, device)
    for _ in range(rounds):
        for mode, span in spans.items():
            prefill, decode, outputs[mode] = timed(span, hidden, device)
            times[mode][0].append(prefill)
            times[mode][1].append(decode)
    exact = outputs[Quantization.NONE].float()
    originals = [m.weight for m in spans[Quantization.NONE].modules() if type(m) is nn.Linear]
    rows = []
    for mode, span in spans.items():
        weights, other = held(span)
        rounded = [m.weight for m in span.modules() if type(m) is nn.Linear or isinstance(m, QuantizedLinear)]
        weight_error = statistics.mean(float((r - w).norm() / w.norm()) for r, w in zip(rounded, originals))
        rows.append({
            "mode": str(mode),
            "weights": weights,
            "other": other,
            "prefill": statistics.median(times[mode][0]),
            "decode": statistics.median(times[mode][1]),
            "weight_error": weight_error,
            "error": float((outputs[mode].float() - exact).abs().max() / exact.abs().max()),
        })  # fmt: skip
    return rows


def section(model: models.BenchModel, rows: list[dict], device: str, dtype: str, rounds: int) -> str:
    base = rows[0]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"## {model.name} on {device} ({when})",
        "",
        f"{model.description}, blocks 0:{model.config.num_hidden_layers} in {dtype}, {torch.get_num_threads()} torch "
        f"threads, torch {torch.__version__}; medians of {rounds} rounds.",
        "",
        "| quantization | linear weights (MiB) | other (MiB) | weights vs none | prefill 128 (ms) | decode step (ms) "
        "| prefill vs none | decode vs none | weight error | output difference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['weights'] / 2**20:.1f} | {r['other'] / 2**20:.1f} | {r['weights'] / base['weights']:.3f}x "
            f"| {r['prefill'] * 1e3:.1f} | {r['decode'] * 1e3:.2f} | {r['prefill'] / base['prefill']:.2f}x "
            f"| {r['decode'] / base['decode']:.2f}x | {r['weight_error']:.4f} | {r['error']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quantize", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=models.MODELS, default="tiny")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on cpu, else bfloat16")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    p.add_argument("--cache-dir", type=Path, help="swarmlm cache (default: $SWARMLM_CACHE_DIR or ~/.cache/swarmlm)")
    p.add_argument("--models-dir", type=Path, help="where random models are built (default: CACHE/bench-models)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    from swarm.paths import default_cache_dir

    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    cache_dir = args.cache_dir or Path(os.environ.get("SWARMLM_CACHE_DIR") or default_cache_dir())
    model = models.resolve(
        args.config,
        models_dir=args.models_dir or cache_dir / "bench-models",
        cache_dir=cache_dir,
        dtype=dtype,
        device=args.device,
    )
    rows = measure(model, args.rounds, torch.device(args.device), getattr(torch, dtype))
    text = section(model, rows, args.device, dtype, args.rounds)
    print(text)
    if not args.out.is_file():
        args.out.write_text(HEAD)
    write_section(args.out, text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
