"""bench/bandwidth.py's table and flags (the runs themselves need a rate-limited namespace and minutes: run
`python -m bench.bandwidth`, whose figures are in bench/figures/bandwidth.md)."""

from __future__ import annotations

import pytest

from bench.bandwidth import RUNS, _section, main


def test_the_table_gives_every_run_against_one_trainer():
    figures = {
        name: {"tokens_per_s": 100.0 * (i + 1), "round_bytes_per_sample": 2e6 * i, "final_loss": 8.0, "losses": []}
        for i, name in enumerate(RUNS)
    }
    table = _section(100, 8, figures)
    assert table.startswith("## A 100 Mbit/s link (")
    assert "| 1 trainer | 100.0 | 1.00x | 0.00 MB | 8.0000 |" in table
    assert "| 2 trainers, --local-steps 4, int8 rounds | 400.0 | 4.00x | 6.00 MB | 8.0000 |" in table


@pytest.mark.parametrize("flags", [["--steps", "2"], ["--rate-mbit", "0"]])
def test_wrong_flags_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    assert "--steps must exceed 2 and --rate-mbit must be positive" in capsys.readouterr().err
