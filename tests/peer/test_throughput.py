"""peer/throughput.py: a measured throughput is cached under everything that sets the span's speed, so that a peer
never announces what a span computed another way measured."""

from __future__ import annotations

import json

import torch

from peer.blocks import load_span
from peer.experts import install_expert_cache
from peer.offload import DiskStore
from peer.throughput import measure_throughput, throughput_key
from protocol.vocab import Quantization
from swarm.models.checkpoint import load_config
from tests.helpers.models import MOE_CONFIGS, llama_config, save_random_model

CPU = torch.device("cpu")


def _span(path, **load):
    return load_span(path, load_config(path), 0, 2, dtype=torch.float32, device=CPU, **load)


def test_each_way_of_holding_the_weights_is_measured_and_cached_apart(tmp_path):
    dense = save_random_model(llama_config(2), tmp_path / "llama", seed=0)
    moe = save_random_model(MOE_CONFIGS["mixtral"](2), tmp_path / "mixtral", seed=0)
    resident, cached_experts = _span(moe), _span(moe)
    install_expert_cache(cached_experts, 1, prefetch=False)
    streamed = _span(dense, stream=(0, DiskStore(CPU, tmp_path / "store")))
    try:
        spans = {
            "dense": _span(dense),
            "int8": _span(dense, quantization=Quantization.INT8),
            "streamed": streamed,
            "moe": resident,
            "moe, 1 expert a layer": cached_experts,
        }
        keys = {name: throughput_key(span) for name, span in spans.items()}
        assert len(set(keys.values())) == len(keys), keys

        cache_file = tmp_path / "throughput.json"
        measured = {name: measure_throughput(span, cache_file) for name, span in spans.items()}
        assert all(value > 0 for value in measured.values())
        assert json.loads(cache_file.read_text()) == {keys[name]: measured[name] for name in spans}
        assert measure_throughput(spans["dense"], cache_file) == measured["dense"]  # read back, not measured again
    finally:
        streamed.close()


def test_moe_configs_of_other_expert_counts_are_other_keys(tmp_path):
    config = MOE_CONFIGS["mixtral"](2)
    more = MOE_CONFIGS["mixtral"](2)
    more.num_local_experts *= 2
    keys = {
        throughput_key(_span(save_random_model(c, tmp_path / name, seed=0)))
        for name, c in (("four", config), ("eight", more))
    }
    assert len(keys) == 2, keys
