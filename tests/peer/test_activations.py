"""Kept activations: bounded store, and a backward that uses them equals one that recomputes the forward."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from peer.activations import ActivationStore, Kept
from peer.blocks import load_span
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.handler import PeerServicer
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.packing import Packer
from swarm.models.checkpoint import load_config
from tests.helpers.models import HIDDEN_SIZE
from tests.helpers.servicers import served


def _kept(nbytes: int) -> Kept:
    x = torch.zeros(1)
    return Kept((0, 1), x, x, None, None, nbytes)


def test_store_evicts_oldest_and_refuses_what_never_fits():
    store = ActivationStore(max_bytes=100, ttl_s=60)
    assert store.put("a", _kept(40)) and store.put("b", _kept(40))
    assert store.put("c", _kept(40))  # evicts a
    assert store.pop("a") is None and len(store) == 2 and store.bytes == 80
    assert not store.put("huge", _kept(101))
    assert store.pop("b") is not None and store.bytes == 40
    store.clear()
    assert len(store) == 0 and store.bytes == 0


def test_store_entries_expire():
    store = ActivationStore(max_bytes=100, ttl_s=0.05)
    store.put("a", _kept(10))
    time.sleep(0.1)  # the time-to-live is what is tested: the store reads the clock, there is no event to wait for
    assert store.pop("a") is None and store.bytes == 0


def test_counting_leaves_parameters_out():
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(8, 256, requires_grad=True)
    with ActivationStore.counting(layer) as saved:
        torch.relu(layer(x)).sum()
    # relu's output (8 x 256 floats) and the input x; not the 256 x 256 weight
    assert 0 < saved.bytes < 256 * 256 * 4
    assert saved.bytes >= 8 * 256 * 4


NUM_LAYERS = 3


@pytest.fixture(scope="module")
def span(tiny_llama_path):
    path = Path(tiny_llama_path)
    return load_span(path, load_config(path), 0, NUM_LAYERS, dtype=torch.float32, device=torch.device("cpu"))


def _reference_grad(span, hidden, grad):
    inputs = hidden.clone().requires_grad_(True)
    with torch.enable_grad():
        (result,) = torch.autograd.grad(span(inputs), inputs, grad)
    return result


def _serve_and_call(span, activation_bytes: int, calls):
    """Run `calls(call, servicer)` against a real servicer over gRPC; `call(method, request)` decodes the answer."""
    limits = ServingLimits(session_timeout_s=60, alloc_timeout_s=5, activation_cache_bytes=activation_bytes)
    servicer = PeerServicer(span.config, "test-model", CacheBudget(1024), limits, pb.InfoResponse)
    servicer.set_span(span)

    async def go():
        async with served(servicer) as (endpoint, pool):

            async def call(method: str, request):
                response = await pool.unary(endpoint, method, request, 30)
                field = "hidden_states" if method == "forward" else "grad_inputs"
                return decode_tensor(getattr(response.message, field), field, response.payload)

            try:
                return await calls(call, servicer)
            finally:
                servicer.close()

    return servicer, asyncio.run(go())


def _forward(hidden, backward_id: str):
    packer = Packer()
    return packer.pack(
        pb.ForwardRequest(
            span=pb.Span(model="test-model", start=0, end=NUM_LAYERS),
            hidden_states=packer.tensor(hidden),
            backward_id=backward_id,
        )
    )


def _backward(hidden, grad, backward_id: str):
    packer = Packer()
    return packer.pack(
        pb.BackwardRequest(
            span=pb.Span(model="test-model", start=0, end=NUM_LAYERS),
            hidden_states=packer.tensor(hidden),
            grad_outputs=packer.tensor(grad),
            backward_id=backward_id,
        )
    )


def test_backward_uses_kept_activations_and_matches_recompute(span):
    hidden, grad = torch.randn(2, 9, HIDDEN_SIZE), torch.randn(2, 9, HIDDEN_SIZE)
    other = torch.randn(2, 9, HIDDEN_SIZE)
    expected = _reference_grad(span, hidden, grad)
    sizes = []

    async def calls(call, servicer):
        out = await call("forward", _forward(hidden, "f1"))
        sizes.append((len(servicer.activations), servicer.activations.bytes))
        kept_grad = await call("backward", _backward(hidden, grad, "f1"))  # uses the kept graph
        sizes.append(len(servicer.activations))
        unknown_grad = await call("backward", _backward(hidden, grad, "never-sent"))  # recomputes
        await call("forward", _forward(hidden, "f2"))
        mismatch_grad = await call("backward", _backward(other, grad, "f2"))  # other inputs: recomputes
        return out, kept_grad, unknown_grad, mismatch_grad

    _, (out, kept_grad, unknown_grad, mismatch_grad) = _serve_and_call(span, 1 << 26, calls)
    with torch.inference_mode():
        torch.testing.assert_close(out, span(hidden), atol=1e-6, rtol=0)
    (entries, nbytes), entries_after = sizes
    assert entries == 1 and nbytes > hidden.numel() * 4 and entries_after == 0
    torch.testing.assert_close(kept_grad, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(unknown_grad, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(mismatch_grad, _reference_grad(span, other, grad), atol=1e-6, rtol=0)


def test_no_activation_memory_means_recompute(span):
    hidden, grad = torch.randn(1, 5, HIDDEN_SIZE), torch.randn(1, 5, HIDDEN_SIZE)

    async def calls(call, servicer):
        await call("forward", _forward(hidden, "f"))
        return await call("backward", _backward(hidden, grad, "f"))

    servicer, got = _serve_and_call(span, 0, calls)
    assert len(servicer.activations) == 0
    torch.testing.assert_close(got, _reference_grad(span, hidden, grad), atol=1e-6, rtol=0)
