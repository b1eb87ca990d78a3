"""A peer's part in the load-balancing loss of MoE training: its Forward reports router sums, its Backward takes
their gradient, with kept activations or recomputing alike; what it cannot use is refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.blocks import load_span
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.handler import PeerServicer
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadRequestError
from protocol.packing import Packer
from swarm.models.checkpoint import load_config
from swarm.models.routers import RouterStats, check_stats
from tests.helpers.models import HIDDEN_SIZE, MOE_CONFIGS, save_random_model
from tests.helpers.servicers import served

BLOCKS = (0, 3)  # Qwen2-MoE's block 1 is a plain MLP: two routed layers here
EXPERTS, TOP_K = 4, 2


def _span(path):
    return load_span(path, load_config(path), *BLOCKS, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def moe_span(tmp_path_factory):
    return _span(save_random_model(MOE_CONFIGS["qwen2_moe"](4), tmp_path_factory.mktemp("qwen2-moe")))


def _serve(span, calls):
    limits = ServingLimits(session_timeout_s=60, alloc_timeout_s=5, activation_cache_bytes=1 << 26)
    servicer = PeerServicer(span.config, "m", CacheBudget(1024), limits, pb.InfoResponse)
    servicer.set_span(span)

    async def go():
        async with served(servicer) as (endpoint, pool):
            try:
                return await calls(lambda method, request: pool.unary(endpoint, method, request, 30))
            finally:
                servicer.close()

    return asyncio.run(go())


def _forward(hidden, backward_id: str = "", router_stats: bool = True):
    packer = Packer()
    return packer.pack(
        pb.ForwardRequest(
            span=pb.Span(model="m", start=BLOCKS[0], end=BLOCKS[1]),
            hidden_states=packer.tensor(hidden),
            backward_id=backward_id,
            router_stats=router_stats,
        )
    )


def _backward(hidden, grad, router_grad, backward_id: str = ""):
    packer = Packer()
    return packer.pack(
        pb.BackwardRequest(
            span=pb.Span(model="m", start=BLOCKS[0], end=BLOCKS[1]),
            hidden_states=packer.tensor(hidden),
            grad_outputs=packer.tensor(grad),
            backward_id=backward_id,
            router_grad=router_grad,
        )
    )


def _grad_inputs(response) -> torch.Tensor:
    return decode_tensor(response.message.grad_inputs, "grad_inputs", response.payload)


def test_router_sums_and_their_gradient_equal_the_span_computed_here(moe_span):
    generator = torch.Generator().manual_seed(0)
    hidden, grad = (
        torch.randn(2, 7, HIDDEN_SIZE, generator=generator),
        torch.randn(2, 7, HIDDEN_SIZE, generator=generator),
    )
    router_grad = [0.3, -0.2, 0.5, 0.1]
    # here: the span with its routers recorded, and the gradient of out . grad + router_grad . probs
    stats = RouterStats(EXPERTS, TOP_K)
    inputs = hidden.clone().requires_grad_(True)
    with torch.enable_grad():
        out = moe_span(inputs, routers=stats)
        (expected,) = torch.autograd.grad([out, stats.probs], inputs, [grad, torch.tensor(router_grad)])
        (without,) = torch.autograd.grad(moe_span(inputs), inputs, grad)

    async def calls(call):
        answered = await call("forward", _forward(hidden, "kept"))
        kept = _grad_inputs(await call("backward", _backward(hidden, grad, router_grad, "kept")))
        recomputed = _grad_inputs(await call("backward", _backward(hidden, grad, router_grad)))
        # kept without router sums: the peer recomputes them for the router gradient
        await call("forward", _forward(hidden, "plain", router_stats=False))
        plain_kept = _grad_inputs(await call("backward", _backward(hidden, grad, router_grad, "plain")))
        return answered.message.router, kept, recomputed, plain_kept

    reported, *answers = _serve(moe_span, calls)
    counts, probs, rows = check_stats(reported, EXPERTS, TOP_K, "p")
    assert rows == 2 * 7 * 2  # rows times the two routed layers
    torch.testing.assert_close(torch.tensor(counts, dtype=torch.float64), stats.counts)
    torch.testing.assert_close(torch.tensor(probs, dtype=torch.float64), stats.probs.detach().double())
    for answer in answers:
        torch.testing.assert_close(answer, expected, atol=1e-6, rtol=1e-5)
    assert float((expected - without).abs().max()) > 1e-4  # the router term moved the input gradient


def test_router_gradients_it_cannot_use_are_refused(moe_span, tiny_llama_path):
    hidden, grad = torch.randn(1, 4, HIDDEN_SIZE), torch.randn(1, 4, HIDDEN_SIZE)

    async def calls(call):
        for bad, says in [([0.1, 0.2], "one per expert"), ([0.1, float("nan"), 0.0, 0.0], "not finite")]:
            with pytest.raises(BadRequestError, match=says):
                await call("backward", _backward(hidden, grad, bad))
        return await call("backward", _backward(hidden, grad, [0.0] * EXPERTS))  # the peer still serves

    assert _grad_inputs(_serve(moe_span, calls)).shape == hidden.shape

    async def dense(call):
        answered = await call("forward", _forward(hidden))  # a dense model reports no sums
        assert not answered.message.HasField("router")
        with pytest.raises(BadRequestError, match="no routers"):
            await call("backward", _backward(hidden, grad, [0.1] * EXPERTS))

    _serve(_span(tiny_llama_path), dense)
