"""How many blocks a peer can hold at each quantization, and `--quantize auto` (peer/capacity.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from peer.blocks import load_span
from peer.capacity import MODES, Capacity, capacity, choose_quantization, held_bytes
from peer.config import PeerConfig, QuantizeChoice, TrainingConfig
from protocol.vocab import Quantization
from swarm.models.checkpoint import load_config
from tests.helpers.models import llama_config, save_random_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = llama_config(2)
    config.hidden_size, config.intermediate_size = 256, 512  # linear weights dominate, as in real models
    return save_random_model(config, tmp_path_factory.mktemp("wide") / "llama", seed=1)


@pytest.mark.parametrize("mode", MODES)
def test_the_estimate_is_what_a_loaded_block_holds(checkpoint, mode):
    config = load_config(checkpoint)
    span = load_span(checkpoint, config, 0, 1, dtype=torch.float32, device=torch.device("cpu"), quantization=mode)
    gc.collect()
    held = sum(t.numel() * t.element_size() for t in [*span.layers[0].parameters(), *span.layers[0].buffers()])
    estimate = held_bytes(checkpoint, config, 0, torch.float32, mode)
    assert abs(estimate - held) <= 0.02 * held, (mode, estimate, held)


def test_auto_takes_the_least_rounding_at_which_the_blocks_fit(checkpoint):
    config = load_config(checkpoint)
    found = capacity(checkpoint, config, torch.float32, 1 << 30)
    assert found.blocks(Quantization.NONE) < found.blocks(Quantization.INT8) < found.blocks(Quantization.NF4)
    per_block = found.per_block
    tight = Capacity(per_block[Quantization.NONE] + per_block[Quantization.INT8], per_block)  # one full block
    assert tight.blocks(Quantization.NONE) == 1 < tight.blocks(Quantization.INT8) < tight.blocks(Quantization.NF4)
    assert choose_quantization(tight, 1) == Quantization.NONE
    assert choose_quantization(tight, 2) == Quantization.INT8
    assert choose_quantization(tight, tight.blocks(Quantization.NF4)) == Quantization.NF4
    assert choose_quantization(tight, None) == Quantization.NONE  # no count asked: the blocks are chosen to fit
    with pytest.raises(ValueError, match="do not fit even as nf4"):
        choose_quantization(tight, tight.blocks(Quantization.NF4) + 1)
    assert f"none 1, int8 {tight.blocks(Quantization.INT8)}," in tight.describe(30)


def test_auto_is_a_choice_of_its_own_that_training_and_adapters_accept():
    assert PeerConfig(model="m", quantization="auto").quantization == QuantizeChoice.AUTO
    assert PeerConfig(model="m", blocks=(0, 2), quantization="auto", training=TrainingConfig(run_id="r"))
    assert PeerConfig(model="m", quantization="auto", adapters={"a": "dir"})
    with pytest.raises(ValueError, match="quantization must be one of"):
        PeerConfig(model="m", quantization="fp8")
