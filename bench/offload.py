"""What streaming blocks saves and costs (peer/offload.py, `swarmlm peer --memory-budget SIZE --offload disk|host`):
a model's whole span held resident, against the same span under a budget of a few blocks, each in a fresh process.

Per variant: the process's RSS above what it held before loading (after loading, and its peak over loading and
computing: ru_maxrss), the budget's split, a 128-token prefill and a one-token decode step after it (medians over
rounds), the blocks loaded from the store and how long the compute thread waited for them, and the largest
difference of the output from the resident span's (it must be 0: the same weights compute). On a CPU the budget
bounds RSS, and a streamed block costs a read of its file (from the page cache when the file was just written);
on a GPU it bounds device memory, and host offload copies from pinned memory.

    python -m bench.offload [--config small] [--resident-blocks 2] [--rounds 5] [--device cpu|cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import models
from bench.hop_profile import write_section

FIGURE = Path(__file__).resolve().parent / "figures" / "offload.md"
HEAD = """# Streamed blocks: memory and time

`python -m bench.offload --config CONFIG --device DEVICE`: one section per config and device, replaced when rerun.
What each column is: the docstring of bench/offload.py.
"""
PROMPT = 128
CACHE_TOKENS = 512
REPO = Path(__file__).resolve().parents[1]


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def child(args: argparse.Namespace) -> dict:
    """One variant, in this process: load, compute, measure; the result as a dict."""
    from peer.blocks import load_span
    from peer.offload import DiskStore, HostStore, block_bytes, kv_token_bytes, plan_memory
    from protocol.vocab import Offload
    from swarm.models.checkpoint import load_config, load_tensors

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = load_config(args.model)
    n = config.num_hidden_layers
    sizes = block_bytes(args.model, config, 0, n, dtype)
    token_bytes = kv_token_bytes(config, 0, n, dtype)
    (embeddings,) = load_tensors(args.model, lambda name: name == "model.embed_tokens.weight", dtype=dtype).values()
    ids = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    hidden = embeddings[ids].to(device)
    del embeddings
    stream, plan = None, None
    if args.offload != "none":
        budget = (args.resident_blocks + 2) * max(sizes) + CACHE_TOKENS * token_bytes
        plan = plan_memory(sizes, token_bytes, CACHE_TOKENS, budget, Offload(args.offload))
        store = HostStore(device) if args.offload == "host" else DiskStore(device, Path(args.store_dir))
        stream = (plan.resident, store)
    before = _rss()
    began = time.perf_counter()
    span = load_span(args.model, config, 0, n, dtype=dtype, device=device, stream=stream)
    load_s = time.perf_counter() - began
    after_load = _rss()
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first is a warm-up
            cache = span.new_cache()
            _sync(device)
            began = time.perf_counter()
            out = span(hidden, cache=cache)
            _sync(device)
            prefill.append(time.perf_counter() - began)
            began = time.perf_counter()
            positions = torch.tensor([[PROMPT]], device=device)
            span(hidden[:, -1:], position_ids=positions, cache=cache, prefix_length=PROMPT)
            _sync(device)
            decode.append(time.perf_counter() - began)
    torch.save(out.cpu(), args.output)
    streamer = span.streamer
    result = {
        "variant": args.offload,
        "weights": sum(sizes),
        "budget": plan.budget_bytes if plan else None,
        "split": plan.describe() if plan else "every block resident",
        "rss_load": after_load - before,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
        "load_s": load_s,
        "prefill": statistics.median(prefill[1:]),
        "decode": statistics.median(decode[1:]),
        "prefill_s": prefill[1:],
        "decode_s": decode[1:],
        "loads": streamer.loads if streamer else 0,
        "waited_s": streamer.waited_s if streamer else 0.0,
    }
    if device.type == "cuda":
        result["device_peak"] = torch.cuda.max_memory_allocated(device)
    span.close()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def variants(device: str) -> list[str]:
    """What runs on `device`, the resident span first: host offload only on a GPU (on a CPU, host memory is what
    the budget limits)."""
    return ["none", "disk"] + (["host"] if device == "cuda" else [])


def run_variant(model: models.BenchModel, offload: str, args: argparse.Namespace, work: Path) -> dict:
    output = work / f"{offload}.pt"
    command = [sys.executable, "-m", "bench.offload", "--child", "--model", str(model.path), "--offload", offload]
    command += ["--device", args.device, "--dtype", args.dtype, "--rounds", str(args.rounds)]
    command += ["--resident-blocks", str(args.resident_blocks), "--store-dir", str(work), "--output", str(output)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{offload}: exit {done.returncode}\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["output"] = torch.load(output)
    return result


def section(model: models.BenchModel, rows: list[dict], args: argparse.Namespace) -> str:
    base = rows[0]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    mib = 2**20
    lines = [
        f"## {model.name} on {args.device} ({when})",
        "",
        f"{model.description}, blocks 0:{model.config.num_hidden_layers} in {args.dtype} "
        f"({base['weights'] / mib:.0f} MiB of weights), torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"medians of {args.rounds} rounds.",
        "",
        "| variant | budget (MiB) | split | RSS after load (MiB) | RSS peak (MiB) | load (s) | prefill 128 (ms) "
        "| decode step (ms) | prefill vs resident | decode vs resident | blocks loaded | waited (s) | output difference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = f"{r['budget'] / mib:.0f}" if r["budget"] else "-"
        difference = float((r["output"].float() - base["output"].float()).abs().max())
        lines.append(
            f"| {r['variant']} | {budget} | {r['split']} | {r['rss_load'] / mib:.0f} | {r['rss_peak'] / mib:.0f} "
            f"| {r['load_s']:.1f} | {r['prefill'] * 1e3:.1f} | {r['decode'] * 1e3:.1f} "
            f"| {r['prefill'] / base['prefill']:.2f}x | {r['decode'] / base['decode']:.2f}x | {r['loads']} "
            f"| {r['waited_s']:.2f} | {difference:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.offload", description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=models.MODELS, default="small")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--resident-blocks", type=int, default=2, help="blocks the budget holds beside the two slots")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on cpu, else bfloat16")
    p.add_argument("--out", type=Path, default=FIGURE, help="markdown file to put the table in")
    p.add_argument("--cache-dir", type=Path, help="swarmlm cache (default: $SWARMLM_CACHE_DIR or ~/.cache/swarmlm)")
    p.add_argument("--models-dir", type=Path, help="where random models are built (default: CACHE/bench-models)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    p.add_argument("--store-dir", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import tempfile

    from swarm.paths import default_cache_dir

    cache_dir = args.cache_dir or Path(os.environ.get("SWARMLM_CACHE_DIR") or default_cache_dir())
    model = models.resolve(
        args.config,
        models_dir=args.models_dir or cache_dir / "bench-models",
        cache_dir=cache_dir,
        dtype=args.dtype,
        device=args.device,
    )
    with tempfile.TemporaryDirectory(prefix="swarmlm-offload-bench-", dir=cache_dir) as work:
        rows = [run_variant(model, variant, args, Path(work)) for variant in variants(args.device)]
    text = section(model, rows, args)
    print(text)
    if not args.out.is_file():
        args.out.write_text(HEAD)
    write_section(args.out, text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
