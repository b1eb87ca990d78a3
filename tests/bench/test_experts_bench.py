"""bench/experts.py, shortened: a Mixtral-like model trained a few steps, then every cache setting decodes through
its span; each row's outputs equal the resident span's, LRU alone guesses nothing, and prefetch's loads count."""

from __future__ import annotations

import re

import pytest

from bench.experts import main


def test_every_setting_is_measured_against_the_resident_span(tmp_path):
    out = tmp_path / "experts.md"
    assert main(["--steps", "4", "--train-steps", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "## 4 layers of 8 experts, top-2, trained 2 steps, 4 decode steps (" in text
    rows = re.findall(
        r"^\| (\d) of 8 \| (host|disk) \| (LRU alone|prefetch) \| ([\d.]+)% \| (\d+) .*\| ([\d.]+) \| [\d.]+x \| (.+) \| (.+) \|$",
        text, re.M)  # fmt: skip
    assert [(kept, store, policy) for kept, store, policy, *_ in rows] == [
        (kept, store, policy) for kept in "124" for store in ("host", "disk") for policy in ("LRU alone", "prefetch")
    ]
    hit_rates = {}
    for kept, store, policy, hit_rate, prefetched, loads, waited, difference in rows:
        assert float(difference) < 1e-4  # the same experts computed the same way, whatever was resident
        assert (int(prefetched) > 0) == (policy == "prefetch")
        assert float(loads) >= int(prefetched) / 4  # a guess is a load too
        assert (waited != "-") == (store == "disk" and policy == "prefetch")
        hit_rates.setdefault((kept, policy), set()).add(hit_rate)
    # where the experts wait changes when they arrive, not which are resident: the same picks hit
    assert all(len(rates) == 1 for rates in hit_rates.values()), hit_rates


def test_wrong_counts_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--steps", "0", "--out", str(tmp_path / "x.md")])
