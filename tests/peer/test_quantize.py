"""Quantized blocks (peer/quantize.py): codes within their rounding of the weights, a quarter or a seventh of the
bytes, and a span that computes exactly what the model with its linear weights rounded the same way computes."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from peer.blocks import load_span
from peer.config import PeerConfig, TrainingConfig
from peer.quantize import NF4_CODES, QuantizedLinear, dequantize, dequantized_copy_, quantize
from protocol.records import ServerInfo, ServerState
from protocol.vocab import Quantization
from swarm.models.checkpoint import load_config
from tests.helpers.models import llama_config, save_random_model

MODES = [Quantization.INT8, Quantization.NF4]


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_int8_codes_round_each_weight_to_its_rows_scale():
    weight = torch.randn(48, 100) * torch.linspace(0.01, 3, 48)[:, None]  # rows of very different ranges
    q = quantize(weight, Quantization.INT8)
    assert q.codes.dtype == torch.int8 and q.codes.shape == weight.shape and q.scales.shape == (48,)
    back = dequantize(q, torch.float32)
    assert bool(((back - weight).abs() <= q.scales[:, None] / 2 + 1e-7).all())
    assert bool((q.codes.abs().amax(dim=1) == 127).all())  # each row's largest weight takes the whole range


def test_nf4_codes_are_the_nearest_normal_float_in_blocks_of_64_and_pack_two_to_a_byte():
    weight = torch.randn(3, 50)  # 150 elements: the third block is zero-padded
    q = quantize(weight, Quantization.NF4)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == 96 and q.scales.numel() == 3
    back = dequantize(q, torch.float32)
    assert back.shape == weight.shape
    flat = weight.reshape(-1)
    blocks = F.pad(flat, (0, -flat.numel() % 64)).view(-1, 64)
    scales = blocks.abs().amax(dim=1)
    for i, (w, b) in enumerate(zip(flat, back.reshape(-1))):
        candidates = NF4_CODES * scales[i // 64]
        assert b == candidates[(candidates - w).abs().argmin()], i


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_linear_computes_what_a_linear_of_the_rounded_weights_computes(mode, dtype):
    linear = nn.Linear(64, 96, bias=True).to(dtype)
    quantized = QuantizedLinear(linear, mode)
    reference = nn.Linear(64, 96, bias=True).to(dtype)
    reference.load_state_dict(linear.state_dict())
    dequantized_copy_(reference, mode)
    x = torch.randn(2, 5, 64, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(quantized(x), reference(x))
    assert quantized.weight.dtype == dtype and torch.equal(quantized.weight, reference.weight)
    assert not any(p is linear.weight for p in quantized.parameters())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_model(llama_config(4), tmp_path_factory.mktemp("llama"), seed=5)


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_span_equals_the_model_with_rounded_weights_in_a_fraction_of_the_bytes(checkpoint, mode):
    config = load_config(checkpoint)
    cpu = torch.device("cpu")
    full = load_span(checkpoint, config, 0, 4, dtype=torch.float32, device=cpu)
    span = load_span(checkpoint, config, 0, 4, dtype=torch.float32, device=cpu, quantization=mode)
    assert span.quantization == mode and sum(isinstance(m, QuantizedLinear) for m in span.modules()) == 4 * 7
    linear_bytes = sum(_bytes(m) for m in full.modules() if type(m) is nn.Linear)
    quantized_bytes = sum(_bytes(m) for m in span.modules() if isinstance(m, QuantizedLinear))
    # int8: a byte per weight and 4 per row (rows of 64 here: 0.27 of float32); nf4: half a byte and 4 per 64
    assert quantized_bytes < linear_bytes * (0.27 if mode == Quantization.INT8 else 0.15)

    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    dequantized_copy_(reference.model.layers, mode)
    ids = torch.randint(3, 128, (2, 7))
    captured = {}
    handle = reference.model.norm.register_forward_hook(lambda m, args, out: captured.setdefault("h", args[0]))
    with torch.no_grad():
        reference(ids)
        got = span(reference.model.embed_tokens(ids))
    handle.remove()
    torch.testing.assert_close(got, captured["h"], atol=1e-5, rtol=0)
    with torch.no_grad():
        unrounded = full(reference.model.embed_tokens(ids))
    assert float((unrounded - got).abs().max()) > 1e-4  # the rounding is real: the reference had to follow it


def test_a_training_peer_cannot_be_quantized_and_records_say_how_weights_are_held():
    with pytest.raises(ValueError, match="drop --quantize int8 or --train"):
        PeerConfig(model="m", blocks=(0, 2), quantization="int8", training=TrainingConfig(run_id="r"))
    with pytest.raises(ValueError, match="quantization"):
        PeerConfig(model="m", quantization="fp8")
    info = dict(state=ServerState.ONLINE, start_block=0, end_block=2, throughput=1.0, cache_tokens_left=8,
                dtype="float32", version="3.0", endpoint="127.0.0.1:1")  # fmt: skip
    plain = ServerInfo(**info)
    assert "quantization" not in plain.to_wire()  # read by clients that predate the field, as before
    assert ServerInfo.from_wire(plain.to_wire()).quantization == "none"
    int8 = ServerInfo(**info, quantization="int8")
    assert ServerInfo.from_wire(int8.to_wire()).quantization == "int8"


@pytest.mark.parametrize("mode", MODES)
def test_a_quantized_span_keeps_no_mapping_of_its_checkpoint(tmp_path, mode):
    """A tensor read from a checkpoint maps the whole file: one norm kept from it would keep every full-precision page
    read through it resident, more than the quantized span holds."""
    checkpoint = save_random_model(llama_config(2), tmp_path / "llama", seed=6)
    span = load_span(checkpoint, load_config(checkpoint), 0, 2, dtype=torch.float32, device=torch.device("cpu"),
                     quantization=mode)  # fmt: skip
    gc.collect()
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert [line for line in maps if str(checkpoint) in line] == []
    assert span.quantization == mode
