"""bench/outer_momentum.py's table and flags (the runs take minutes: run `python -m bench.outer_momentum`, whose
figures are in bench/figures/outer_momentum.md)."""

from __future__ import annotations

import pytest

from bench.outer_momentum import SETTINGS, _section, main


def test_the_table_gives_each_settings_norms_and_loss():
    figures = {name: {"norms": [20.0 + i, 1676.2], "final_loss": 3.0 + i / 10} for i, name in enumerate(SETTINGS)}
    table = _section(16, figures, "now")
    assert table.startswith("## 16 steps (now)")
    assert "after steps 8, 16;" in table
    assert "| a round every update | 20 / 1676 | 3.000 |" in table
    assert "| --local-steps 4, momentum 0.9 (DiLoCo's) | 21 / 1676 | 3.100 |" in table


def test_too_few_steps_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "7"])
    assert exit_info.value.code == 2
    assert "--steps must be at least 8" in capsys.readouterr().err
