"""bench/scaling.py's table and flags (the runs themselves need a namespace and minutes: run `python -m
bench.scaling`, whose figures are in bench/figures/scaling.md), and its plot."""

from __future__ import annotations

import json

import pytest

from bench import train_runs as tr
from bench.scaling import RUNS, _mean_phases, _section, _waiting, main
from bench.scaling_plot import draw, series


def step(seconds: dict[str, float], samples: int = 8) -> dict:
    """A --log-json record of a step of 64-token samples: its phases add up to its seconds."""
    return {"samples": samples, "phases": seconds, "tokens_per_s": samples * 64 / sum(seconds.values()), "loss": 1.0}


def test_rates_and_waiting_come_from_the_steps_phases():
    steps = [
        step({"ready": 0.5, "micro_batches": 1.0, "rounds": 0.5, "apply": 0.0, "sync": 0.0}),
        step({"ready": 0.0, "micro_batches": 1.0, "rounds": 0.0, "apply": 0.0, "sync": 1.0}),
    ]
    assert tr.tokens_per_second(steps, 64) == pytest.approx(2 * 8 * 64 / 4.0)
    assert _waiting(steps) == pytest.approx(2.0 / 4.0)
    assert _mean_phases(steps) == pytest.approx(
        {"apply": 0.0, "micro_batches": 1.0, "ready": 0.25, "rounds": 0.25, "sync": 0.5}
    )


def test_the_table_gives_every_run_against_one_trainer():
    figures = {
        name: {
            "tokens_per_s": 100.0 * (i + 1),
            "waiting": 0.25,
            "round_bytes_per_sample": 2e5 * i,
            "final_loss": 8.0,
            "losses": [],
            "phases": {"micro_batches": 0.75, "ready": 0.25},
        }
        for i, name in enumerate(RUNS)
    }
    table = _section(25, 50, 200, "char", 18, figures)
    assert table.startswith(
        "## 25 ms each way and 50 Mbit/s to each peer, 200 Mbit/s in all, 128-character vocabulary ("
    )
    assert "| 1 trainer | 100.0 | 1.00x | 25% | 0.75 / 0.25 / 0.00 / 0.00 / 0.00 / 0.00 | 0.0 kB | 8.0000 |" in table
    assert (
        "| 4 trainers, local steps | 500.0 | 5.00x | 25% | 0.75 / 0.25 / 0.00 / 0.00 / 0.00 / 0.00 | 800.0 kB | 8.0000 |"
        in table
    )


@pytest.mark.parametrize("flags", [["--steps", "2"], ["--rate-mbit", "0"], ["--peer-mbit", "-1"], ["--delay-ms", "-5"]])
def test_wrong_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert "--steps must exceed 2, the rates must be positive and --delay-ms not negative" in capsys.readouterr().err


def test_runs_without_the_one_they_are_measured_against_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--runs", "2 trainers"])
    assert exit_info.value.code == 2
    assert "--runs must include '1 trainer'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--runs", "1 trainer", "3 trainers"])
    assert "invalid choice: '3 trainers'" in capsys.readouterr().err


def test_the_plot_draws_both_lines_of_every_kept_run(tmp_path):
    figures = {name: {"tokens_per_s": 100.0 * (i + 1)} for i, name in enumerate(RUNS)}
    assert series(figures) == {
        "a round every update": ([1, 2, 4], [100.0, 200.0, 300.0]),
        "local steps (8) and int8 syncs": ([1, 2, 4], [100.0, 400.0, 500.0]),
        "the same, syncs overlapped": ([1, 2, 4], [100.0, 800.0, 900.0]),
    }
    older = {name: found for name, found in figures.items() if "overlapped" not in name}
    assert list(series(older)) == ["a round every update", "local steps (8) and int8 syncs"]
    assert draw(tmp_path, tmp_path / "scaling.png") is None  # nothing kept yet
    for vocab in ("char", "smollm2"):
        kept = {"title": f"25 ms, {vocab}", "when": "2026-12-06T17:00:00", "steps": 18, "figures": figures}
        (tmp_path / f"scaling-{vocab}.json").write_text(json.dumps(kept))
    plot = draw(tmp_path, tmp_path / "scaling.png")
    assert plot == tmp_path / "scaling.png" and plot.read_bytes().startswith(b"\x89PNG")
