"""Keeps the benchmark harness from rotting: `python -m bench --quick` on the tiny config, one repetition.

Asserts that the results folder holds every file and that every figure is present and finite; never the speed
(timings belong in the report, not in pass/fail).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from bench.plan import QUICK_SCENARIOS, Plan
from bench.stats import Row, Summary, Target, percentile
from tests.helpers.processes import reaping_descendants

REPO = Path(__file__).resolve().parents[2]


def test_summary_and_targets_on_plain_numbers():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 10) == pytest.approx(1.0)
    summary = Summary.of([3.0, 1.0, 2.0])
    assert (summary.median, summary.min, summary.max, summary.n) == (2.0, 1.0, 3.0, 3)
    row = Row(
        "decode",
        "tiny",
        "3 peers",
        "decode step",
        "ms",
        Summary.of([12.0]),
        Summary.of([10.0]),
        target=Target("ratio", "<=", 1.15, "<= 1.15x local"),
    )
    assert row.ratio == pytest.approx(1.2) and row.met is False
    row.ours = Summary.of([11.0])
    assert row.met is True
    assert Target("value", "<", 10.0, "< 10 s").met(None, 9.9) is True
    excess = Target("excess", "<=", 2.0, "<= 2 ms over")
    assert excess.met(None, 3.4, 1.5) is True and excess.met(None, 3.6, 1.5) is False
    assert excess.met(None, 3.0) is None  # no reference, no verdict
    with pytest.raises(ValueError, match="repeats"):
        Plan(configs=("tiny",), repeats=0)
    with pytest.raises(ValueError, match="scenarios"):
        Plan(configs=("tiny",), scenarios=("nope",))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _our_processes(marker: str) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(process.info.get("cmdline") or [])
        if marker in cmdline and process.pid != psutil.Process().pid:
            found.append(f"{process.pid}: {cmdline[:200]}")
    return found


@pytest.mark.timeout(420)
def test_quick_bench_on_the_tiny_model_writes_every_result(tmp_path):
    out = tmp_path / "results"
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--configs",
            "tiny",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--models-dir",
            str(tmp_path / "models"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with reaping_descendants(bench):  # its peers' DHT processes and p2pd too, also when it times out
        stdout, stderr = bench.communicate(timeout=400)
    assert bench.returncode == 0, f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}"

    for name in ("results.json", "results.md", *(f"{s}.png" for s in QUICK_SCENARIOS)):
        path = out / name
        assert path.is_file() and path.stat().st_size > 0, (
            f"{name} missing from {sorted(p.name for p in out.iterdir())}"
        )

    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    for key in ("cpus", "torch", "reference_threads", "peer_threads", "device", "dtype"):
        assert key in results["machine"], key
    rows = results["rows"]
    assert {row["scenario"] for row in rows} == set(QUICK_SCENARIOS)
    for row in rows:
        where = f"{row['scenario']}/{row['variant']}/{row['metric']}"
        for stat in ("median", "p10", "p90"):
            assert _finite(row["ours"][stat]) and row["ours"][stat] >= 0, where
        if row["reference"] is not None:
            assert _finite(row["reference"]["median"]) and _finite(row["ratio"]), where
        if row["target"] is not None:
            assert row["met"] in (True, False), where

    metrics = {(row["scenario"], row["metric"]) for row in rows}
    for expected in [
        ("decode", "decode step"),
        ("prefill", "prefill time"),
        ("prefill", "prefill throughput"),
        ("train", "forward+backward"),
        ("wire", "ours per hop"),
        ("concurrency", "aggregate decode"),
        ("concurrency", "per-token latency p95"),
        ("startup", "launch to ONLINE"),
        ("startup", "peer RSS after decode"),
    ]:
        assert expected in metrics, expected
    decode = [row for row in rows if row["scenario"] == "decode"]
    assert {row["variant"] for row in decode} == {"3 peers"}
    assert len([row for row in rows if row["metric"] == "launch to ONLINE"]) == 3  # one per peer

    table = (out / "results.md").read_text()
    assert "| model | setting | metric | ours | reference | ratio | target | met |" in table
    assert "Decode latency" in table and "Wire overhead" in table
    assert _our_processes(str(out)) == [], "peer processes outlived the benchmark"


@pytest.mark.timeout(330)
def test_a_terminated_bench_stops_what_it_started_and_reports_what_it_measured(tmp_path):
    """SIGTERM (what `timeout` and schedulers send) after the first model's scenario: what the bench started is
    stopped, and the scenarios finished before it are reported, with the interruption among the errors."""
    out = tmp_path / "results"
    command = [sys.executable, "-m", "bench", "--quick", "--configs", "tiny,small", "--scenarios", "wire"]
    command += ["--repeats", "1", "--out", str(out), "--models-dir", str(tmp_path / "models")]
    bench = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(bench.stderr), daemon=True)
    reader.start()
    with reaping_descendants(bench):  # wire's echo peer process too
        # about 15 s alone; a clean-clone run of the whole suite once took over 90 s to get there
        deadline = time.monotonic() + 240
        while not any("tiny/wire done" in line for line in lines):
            assert bench.poll() is None and time.monotonic() < deadline, "".join(lines[-40:])
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        reader.join(timeout=10)
    assert bench.returncode == 1, "".join(lines[-40:])
    results = json.loads((out / "results.json").read_text())
    assert {(row["scenario"], row["config"]) for row in results["rows"]} == {("wire", "tiny")}
    assert any(error.startswith("interrupted") for error in results["errors"]), results["errors"]
    assert "interrupted" in (out / "results.md").read_text()
