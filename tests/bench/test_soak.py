"""`python -m bench.soak`, short: churn, clients and bad requests together; nothing wrong, lost or leaked.

Three peers (blocks 0:2, 2:4 and 0:4 of a tiny random Llama), two clients (greedy, seeded sampling) and a few
bad requests a second, for 20 s while a peer is stopped every 3-6 s. About 80 s on a busy 2-core machine, most
of it starting processes.
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
    done = subprocess.run([sys.executable, "-m", "bench.soak", "--seconds", "20", "--peers", "3", "--clients", "2",
                           "--kill-every", "3", "6", "--bad-rate", "3", "--rss-every", "2", "--prompts", "3",
                           "--max-new-tokens", "16", "--log-dir", str(tmp_path / "logs"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
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
