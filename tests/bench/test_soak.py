"""`python -m bench.soak`, short: churn, clients and bad requests together; nothing wrong, lost or leaked.

Three peers (blocks 0:2, 2:4 and 0:4 of a tiny random Llama), two clients (greedy, seeded sampling) and a few
bad requests a second, for 12 s while a peer is stopped every 3-6 s. The first stop, a SIGKILL, comes within 6 s;
its replacement takes longer than the rest of the run to start, and no other peer can go until it is ONLINE, so a
longer run mostly waits (20 s gave the same single SIGKILL, with ~100 generations per client). About 55 s on a
busy 2-core machine, most of it starting processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_short_soak_has_no_wrong_lost_or_leaked_generation(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak",
            "--seconds",
            "12",
            "--peers",
            "3",
            "--clients",
            "2",
            "--kill-every-s",
            "3",
            "6",
            "--bad-rate",
            "3",
            "--rss-every",
            "2",
            "--prompts",
            "3",
            "--max-new-tokens",
            "16",
            "--at-least",
            "3",  # the generations compared below, also on a machine too loaded to finish them in 12 s
            "--log-dir",
            str(tmp_path / "logs"),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.is_file(), f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    generations, leaks, churn, traffic = result["generations"], result["leaks"], result["churn"], result["traffic"]
    assert generations["wrong"] == 0, generations["mismatches"]
    assert generations["lost"] == 0, generations["lost_errors"]
    assert generations["greedy"] >= 3 and generations["sampled"] >= 3, generations
    assert (leaks["sessions"], leaks["cache_tokens"], leaks["client_channels"], leaks["tcp_connections"]) == (0,) * 4
    assert leaks["peers_unchecked"] == 0 and len(leaks["peers"]) >= 1, leaks  # restarted ones may still start
    assert churn["crashes"] == 0, churn["crash_logs"]
    assert churn["kills"]["SIGKILL"] >= 1, churn  # the first stop is a SIGKILL
    assert traffic["outcomes"].get("typed", 0) >= 10 and traffic["outcomes"].get("untyped", 0) == 0, traffic
    assert any(r["samples"] >= 3 for r in result["rss"]), result["rss"]
    assert result["missed"] == [] and done.returncode == 0, done.stdout[-3000:]


@pytest.mark.parametrize("num_blocks, peers", [(4, 3), (4, 4), (30, 4), (30, 7), (2, 5)])
def test_overlapping_spans_serve_every_block_twice(num_blocks, peers):
    from bench.soak_fleet import overlapping_spans

    spans = overlapping_spans(num_blocks, peers)
    assert len(spans) == peers and all(0 <= a < b <= num_blocks for a, b in spans)
    assert all(sum(a <= block < b for a, b in spans) >= 2 for block in range(num_blocks))


def test_rss_late_slope_ignores_start_up_growth_but_not_a_leak():
    from bench.soak import rss_figures
    from bench.soak_fleet import Incarnation

    warm = Incarnation("p0.0", (0, 2), 1, 1, 0.0, rss_mib=[(5.0 * i, 400.0 + min(i, 4) * 5) for i in range(30)])
    leaking = Incarnation("p1.0", (0, 2), 2, 2, 0.0, rss_mib=[(5.0 * i, 400.0 + i) for i in range(30)])
    assert rss_figures(warm)["late_slope_mib_per_min"] == 0.0 and rss_figures(warm)["max_mib"] == 420.0
    assert rss_figures(leaking)["late_slope_mib_per_min"] == pytest.approx(12.0)  # 1 MiB per 5 s
