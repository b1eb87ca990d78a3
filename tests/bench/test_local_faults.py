"""bench/local_faults.py's table and flags (the runs take minutes: run `python -m bench.local_faults`, whose figures
are in bench/figures/local_faults.md)."""

from __future__ import annotations

import pytest

from bench.local_faults import _section, fault_kinds, main


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
    overlapped = _section(32, 9, 16, figures(4.0, 4.06), "now", overlap=1)
    assert overlapped.startswith(
        "## 32 steps, a member killed after step 9, a trainer joining after step 16, syncs overlapping 1 update (now)"
    )
    assert "`--local-steps 4 --outer-momentum 0.5 --sync-overlap 1`" in overlapped


def test_faults_are_counted_by_kind_without_their_peers_and_numbers():
    kinds = fault_kinds(
        [
            "stage 2:4 peer 3sdfGHj8 gone at apply",
            "stage 2:4 peer Qm8xYz12 gone at apply",
            "update 3: trainers abc12345, defG789a gone",
            "stage 0:2: members differ after update 7 (2 digests)",
            "update 12: peer ZNkpugBV sits it out (no Info answer within 5s)",
        ]
    )
    assert kinds == [
        ("stage N:N peer X gone at apply", 2),
        ("update N: trainers X gone", 1),
        ("stage N:N: members differ after update N (N digests)", 1),
        ("update N: peer X sits it out (no Info answer within Ns)", 1),
    ]
    faulty = figures(4.0, 4.06)
    faulty["with faults"]["kinds"] = kinds
    assert "- with faults: 2 x `stage N:N peer X gone at apply`" in _section(32, 9, 16, faulty, "now")


@pytest.mark.parametrize(
    "flags",
    [
        ["--kill-at", "0"],
        ["--kill-at", "32"],
        ["--join-at", "28"],
        ["--steps", "8", "--join-at", "4"],
    ],
)
def test_faults_outside_the_run_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert "--kill-at must be within --steps" in capsys.readouterr().err


def test_an_overlap_as_long_as_a_syncs_interval_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--sync-overlap", "4"])
    assert exit_info.value.code == 2
    assert "--sync-overlap must be 0 to 3: below the run's --local-steps 4" in capsys.readouterr().err
