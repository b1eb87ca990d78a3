"""bench/local_faults.py's table and flags (the runs take minutes: run `python -m bench.local_faults`, whose figures
are in bench/figures/local_faults.md)."""

from __future__ import annotations

import pytest

from bench.local_faults import _section, main


def figures(clean: float, faulty: float) -> dict:
    return {
        "fault-free": {"final_loss": clean, "curve": [], "faults": 0, "joiner_steps": 0},
        "with faults": {"final_loss": faulty, "curve": [], "faults": 3, "joiner_steps": 16},
    }


def test_the_table_says_how_far_the_faulty_run_ends_from_the_fault_free_one():
    table = _section(32, 9, 16, figures(4.0, 4.06), "now")
    assert table.startswith("## 32 steps, a member killed after step 9, a trainer joining after step 16 (now)")
    assert "| with faults | 4.0600 | 3 | 16 |" in table
    assert "+1.50% (target within 2%: met)" in table
    assert "-5.00% (target within 2%: missed)" in _section(32, 9, 16, figures(4.0, 3.8), "now")


@pytest.mark.parametrize(
    "flags", [["--kill-at", "0"], ["--kill-at", "32"], ["--join-at", "28"], ["--steps", "8", "--join-at", "4"]]
)
def test_faults_outside_the_run_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert "--kill-at must be within --steps" in capsys.readouterr().err
