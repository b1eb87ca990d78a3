"""Resident memory of processes, and of a fresh process that holds the whole local model (the comparison).

`python -m bench.memory MODEL_DIR --dtype D --device X` first only imports the runtime (torch, transformers,
grpc, hivemind) and notes its memory, the fixed overhead every process pays; then it loads the whole model the
way the reference does, runs one short forward, and prints both as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

MIB = 1024 * 1024


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def peak_rss_mib(pid: int) -> float | None:
    """The process's high-water mark of resident memory (Linux VmHWM), or None where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def children_rss_mib(pid: int) -> dict[str, float]:
    """RSS of each descendant (DHT process, p2pd, ...), by name and pid."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found[f"{child.name()}:{child.pid}"] = child.memory_info().rss / MIB
        except psutil.Error:
            pass
    return found


def gpu_mib_by_pid() -> dict[int, float]:
    """GPU memory per process from nvidia-smi (empty where there is none)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    usage = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            usage[int(parts[0])] = float(parts[1]) if parts[1].replace(".", "").isdigit() else float("nan")
    return usage


def probe(model_dir: Path, *, dtype: str, device: str, timeout_s: float = 600.0) -> dict:
    """Memory of a fresh process: `runtime_only` after importing the runtime, `model` once it holds the model."""
    command = [sys.executable, "-m", "bench.memory", str(model_dir), "--dtype", dtype, "--device", device]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, cwd=Path(__file__).resolve().parents[1]
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory")
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    import grpc  # noqa: F401
    import hivemind  # noqa: F401
    import torch
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM

    pid = psutil.Process().pid
    found = {"runtime_only": {"rss_mib": rss_mib(pid), "peak_rss_mib": peak_rss_mib(pid)}}
    model = (
        AutoModelForCausalLM.from_pretrained(
            args.model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        )
        .to(args.device)
        .eval()
    )
    with torch.inference_mode():
        model(torch.ones(1, 16, dtype=torch.long, device=args.device))
    gpu = 0.0
    if args.device == "cuda":
        torch.cuda.synchronize()
        gpu = torch.cuda.memory_allocated() / MIB
    found["model"] = {"rss_mib": rss_mib(pid), "peak_rss_mib": peak_rss_mib(pid), "gpu_allocated_mib": gpu}
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
