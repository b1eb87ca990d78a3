"""bench/hop_profile.py's report from plain data: the parts of a step add up to it, transport is what the peer's
phases leave of the client's rpc time, and a rerun replaces its own section of the figure file only."""

from __future__ import annotations

import pytest

from bench.hop_profile import table, write_section
from client.session import HopTimings


def _result() -> dict:
    hop = {
        "blocks": (0, 4),
        "peer_steps": 2,
        "parse_s": 0.002,
        "wait_s": 0.0,
        "compute_s": 0.010,
        "reply_s": 0.002,
        "client": HopTimings(steps=2, pack_s=0.001, rpc_s=0.020, check_s=0.001),
    }
    acc = {"embed_head": 0.004, "steps": [0.015, 0.015], "hops": {"peer-a": hop}}
    return {"acc": acc, "local": [0.010], "facade": [0.016], "blocks": {(0, 4): [0.004]}, "outside_cores": 0.5}


def _row(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    return float(line.split("|")[2].strip("* "))


def test_the_parts_of_a_step_add_up_to_it():
    text = table(_result(), "tiny, 1 peers")
    assert _row(text, "hop 0:4 transport") == pytest.approx(10.0 - 7.0)  # per step: rpc 10 ms, peer 1+0+5+1
    parts = [
        float(line.split("|")[2])
        for line in text.splitlines()
        if line.startswith("| ") and "%" in line and "**" not in line
    ]
    assert sum(parts) == pytest.approx(_row(text, "**swarm step, as timed above**"), abs=0.01)
    assert "1.50x local" in text


def test_a_rerun_replaces_only_its_own_section(tmp_path):
    path = tmp_path / "hop_profile.md"
    write_section(path, "## tiny, 3 peers (run 1)\n\nfirst\n")
    write_section(path, "## default, 3 peers (run 1)\n\nother\n")
    write_section(path, "## tiny, 3 peers (run 2)\n\nsecond\n")
    text = path.read_text()
    assert text.startswith("# ") and "other" in text and "second" in text and "first" not in text
    assert text.index("default, 3 peers") < text.index("tiny, 3 peers")
