"""`swarmlm bench` / `python -m bench`: flags -> Plan -> scenarios per model -> results folder.

For each model: the wire scenario (no peers needed), a memory probe of the whole local model, then the
model's blocks split over 3, then fewer, fresh peers; each split runs the chosen scenarios side by side with
the local reference. A failing scenario is recorded and the run goes on; the exit code is 1 if any failed.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import signal
import sys
import time
from pathlib import Path

# Before torch loads, since libgomp reads it once: this process's idle OpenMP threads then sleep instead of
# spinning on the cores its co-located peers are about to compute on. The local reference measured the same
# either way (bench/figures/tiny.md); `OMP_WAIT_POLICY=` (empty) keeps libgomp's own policy.
OWN_OMP_POLICY = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE") if "torch" not in sys.modules else None

from bench.models import MODELS  # noqa: E402
from bench.plan import DEVICES, DTYPES, SCENARIOS, Plan, cpu_count, preset  # noqa: E402
from swarm.extras import EXTRAS, install_hint, missing_modules  # noqa: E402

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark the swarm on this machine against local references.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the default model, fewer settings (~2 min on 2 cores)")
    mode.add_argument(
        "--full",
        action="store_true",
        help="every scenario and model (the default, ~47 min: train_swarm ~20, speculative ~6 of them)",
    )
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where peers and the reference compute")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--scenarios", type=_names, help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--configs", type=_names, help=f"comma-separated models among {','.join(MODELS)}")
    p.add_argument("--repeats", type=int, help="repeated runs per measurement (quick: 3, full: 5)")
    p.add_argument("--peer-threads", type=int, help="torch threads per peer process (default: as the reference)")
    p.add_argument(
        "--peer-omp-passive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start peers with OMP_WAIT_POLICY=PASSIVE so idle peers do not spin on shared cores (default: on)",
    )
    p.add_argument(
        "--reference-threads",
        type=int,
        help="torch threads of this process, the local reference's (default: torch's, all cores)",
    )
    p.add_argument("--out", type=Path, help="results folder (default: bench/results/<timestamp>)")
    p.add_argument("--models-dir", type=Path, help="where random models are built once (default: CACHE/bench-models)")
    p.add_argument("--cache-dir", help="swarmlm cache holding the default model (default: ~/.cache/swarmlm)")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    plan = preset(quick=args.quick, device=args.device)
    changes = {}
    for flag, field in (
        ("dtype", "dtype"),
        ("scenarios", "scenarios"),
        ("configs", "configs"),
        ("repeats", "repeats"),
        ("peer_threads", "peer_threads"),
        ("reference_threads", "reference_threads"),
    ):
        if getattr(args, flag) is not None:
            changes[field] = getattr(args, flag)
    changes["peer_omp_passive"] = args.peer_omp_passive
    if args.peer_threads is None:  # as many as the reference: one pipeline stage computes at a time
        changes["peer_threads"] = args.reference_threads or _torch_threads()
    unknown = sorted(set(changes.get("configs", ())) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown configs {unknown}; choose from {', '.join(MODELS)}")
    return plan.replace(**changes)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _machine(plan: Plan) -> dict:
    import torch

    info = {
        "cpus": cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "reference_threads": torch.get_num_threads(),
        "peer_threads": plan.peer_threads,
        "device": plan.device,
        "dtype": plan.dtype,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if plan.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run(args: argparse.Namespace) -> int:
    import torch

    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu",
            file=sys.stderr,
        )
        return 2
    if plan.reference_threads:
        torch.set_num_threads(plan.reference_threads)
    # stop like Ctrl+C: the harness stops the peers on the way out, and what was measured is still reported
    signal.signal(signal.SIGTERM, _interrupt)
    warn_missing_plots()
    from swarm.paths import default_cache_dir

    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    models_dir = args.models_dir or cache_dir / "bench-models"
    started = datetime.datetime.now()
    out_dir = args.out or RESULTS_DIR / started.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = _machine(plan)
    began = time.monotonic()

    from bench.runner import run_models

    rows, errors, descriptions = run_models(plan, models_dir=models_dir, cache_dir=cache_dir, out_dir=out_dir)

    machine["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    elapsed = time.monotonic() - began
    header = {
        "mode": "quick" if plan.quick else "full",
        "started": started.isoformat(timespec="seconds"),
        "elapsed_s": elapsed,
        "machine": machine,
        "plan": dict(vars(plan)),
        "models": descriptions,
        "errors": errors,
        "summary": {
            "machine": f"{machine['cpus']} CPUs, torch {machine['torch']}, {plan.device} {plan.dtype}"
            + (f", {machine['gpu']}" if "gpu" in machine else ""),
            "threads": f"reference/client process {machine['reference_threads']}"
            + f" with OMP_WAIT_POLICY={OWN_OMP_POLICY or 'unset'}, each peer {plan.peer_threads}"
            + (" with OMP_WAIT_POLICY=PASSIVE" if plan.peer_omp_passive else ""),
            "models": "; ".join(f"{k}: {v}" for k, v in descriptions.items()),
            "load average (1 min) at start/end": f"{_load(machine['load_average_at_start'])} / "
            f"{_load(machine['load_average_at_end'])}",
            "elapsed": f"{elapsed:.0f} s",
        },
        "notes": [*NOTES, _memory_note(plan, rows)],
    }
    from bench.report import write

    paths = write(out_dir, rows, header)
    print(paths["markdown"].read_text())
    print(f"results in {out_dir}")
    return 1 if errors else 0


def warn_missing_plots() -> bool:
    """Say before the scenarios run that no plots will be drawn without matplotlib; True if so."""
    missing = missing_modules(EXTRAS["bench"])
    if missing:
        print(
            f"note: {', '.join(missing)} is not installed: the results get their tables and JSON but no plots; "
            f"for plots: {install_hint('bench')}",
            file=sys.stderr,
            flush=True,
        )
    return bool(missing)


def _memory_note(plan: Plan, rows) -> str:
    note = (
        f"Peer memory target: RSS after decode <= its share of the weights + its KV cache + "
        f"{plan.memory_overhead_mib:.0f} MiB fixed runtime overhead (Python, torch, transformers, gRPC server, "
        f"hivemind DHT client)"
    )
    runtime = next(
        (r.extra["runtime_only_process"]["rss_mib"] for r in rows if "runtime_only_process" in r.extra), None
    )
    if runtime is not None:
        note += f"; a process that only imports that runtime holds {runtime:.0f} MiB"
    return note + "."


def _load(value) -> str:
    return f"{value[0]:.2f}" if value else "-"


NOTES = [
    "Peers are real `swarmlm peer` processes on 127.0.0.1 (one bootstrap node per model); the reference runs "
    "in this same process, with the same checkpoint folder and dtype, alternating with the swarm runs.",
    "Decode: each forward of one new token is timed (embeddings and LM head included on both sides); the swarm "
    "inside an inference session, the reference with its DynamicCache.",
    "Forward+backward: blocks frozen on both sides (peers only return input gradients, from the activations "
    "they kept since the forward); embeddings and LM head trainable.",
    "Concurrency: N inference sessions at once through one client library instance (one channel per peer).",
    "Wire: client and an echo peer (real PeerServicer, identity span) in one fresh process, one event loop, "
    "torch threads as a peer's; calls of the three transports interleaved one by one.",
]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("SWARMLM_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    args = build_parser("python -m bench").parse_args(argv)
    if args.cache_dir is None:
        args.cache_dir = os.environ.get("SWARMLM_CACHE_DIR")
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
