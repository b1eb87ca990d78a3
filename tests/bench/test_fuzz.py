"""`python -m bench.fuzz` against a live peer, small: every mutated request gets a typed answer.

The same run on the code before protocol/service.py turned refused bytes into typed errors counted 186
untyped answers (UNKNOWN statuses) in 600 requests; so this test fails when that breaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_fuzz_run_has_no_crash_no_untyped_answer_and_an_exact_honest_session(tmp_path):
    out = tmp_path / "fuzz.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.fuzz", "--count", "300", "--minutes", "2", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.is_file(), f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["total"] == 300 and set(result["tried"]) == {"forward", "backward", "open", "step", "info", "state"}
    assert result["crashes"] == 0, result["crash_log"]
    assert result["untyped"] == 0, result["untyped_examples"]
    assert result["honest_exact"] and result["honest_steps"] >= 30, result
    assert result["outcomes"].get("forward/typed", 0) > 0 and result["outcomes"].get("forward/ok", 0) > 0
    assert done.returncode == 0, done.stdout[-3000:]
