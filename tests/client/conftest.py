"""Fixtures of the client's tests on an in-memory swarm (tests/helpers/fake_swarm.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.fake_swarm import FakeSwarm


@pytest.fixture(scope="session")
def tiny_llama_local(tiny_llama_path):
    """The local reference: the whole tiny Llama that the fake swarm's peers serve the blocks of."""
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture
def fake_swarm(tiny_llama_path):
    """An empty FakeSwarm of the tiny Llama (add peers with `add_peer`); its loop and peers are stopped afterwards."""
    with FakeSwarm(tiny_llama_path) as swarm:
        yield swarm
