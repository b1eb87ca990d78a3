"""bench/quantize.py on a tiny Llama: one row per quantization, the bytes each holds, and outputs that differ from
the unquantized span's by the rounding only."""

from __future__ import annotations

import torch

from bench.models import BenchModel
from bench.quantize import measure, section
from swarm.models.checkpoint import load_config
from tests.helpers.models import make_tiny


def test_each_quantization_is_measured_against_the_unquantized_span(tmp_path):
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=1)
    model = BenchModel("tiny-test", path, load_config(path), "a test model")
    rows = measure(model, 1, torch.device("cpu"), torch.float32)
    assert [r["mode"] for r in rows] == ["none", "int8", "nf4"]
    none, int8, nf4 = rows
    assert none["error"] == 0 and 0 < int8["error"] < nf4["error"]  # 4 bits round more than 8
    assert int8["weights"] < 0.27 * none["weights"] and nf4["weights"] < 0.15 * none["weights"]
    assert all(r["prefill"] > 0 and r["decode"] > 0 for r in rows)
    text = section(model, rows, "cpu", "float32", 1)
    assert text.startswith("## tiny-test on cpu") and text.count("\n| ") == 4  # the header and three rows
