"""Bad requests against a live peer get typed errors naming the problem, and the peer keeps serving others."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from client.transport import ChannelPool, InferenceStream
from peer.blocks import load_span
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor, encode_tensor
from protocol.errors import (
    BadRequestError,
    CacheFullError,
    MessageTooLargeError,
    SequenceTooLongError,
    UnknownSessionError,
    WrongSpanError,
)
from protocol.packing import Packer
from protocol.records import prefix_for_model
from swarm.checkpoint import load_config
from tests.helpers.models import HIDDEN_SIZE

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def peer(tmp_path_factory, tiny_llama_path):
    """One peer serving all 4 blocks, with small limits so they can be hit: (endpoint, prefix, local span)."""
    from tests.helpers.processes import Swarm

    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        swarm.start_peer(
            tiny_llama_path, "--blocks", f"0:{NUM_LAYERS}", "--max-message-mb", "0.25",
            "--cache-tokens", "96", "--alloc-timeout", "0.5",
        )
        prefix = prefix_for_model(str(tiny_llama_path))
        snapshot = swarm.wait_online(prefix, [(0, NUM_LAYERS)])
        (info,) = snapshot.online().values()
        span = load_span(Path(tiny_llama_path), load_config(Path(tiny_llama_path)), 0, NUM_LAYERS,
                         dtype=torch.float32, device=torch.device("cpu"))
        yield info.endpoint, prefix, span


def run(coro):
    return asyncio.run(coro)


def _span(prefix: str, start: int = 0, end: int = NUM_LAYERS) -> pb.Span:
    return pb.Span(model=prefix, start=start, end=end)


async def _forward(endpoint: str, request: pb.ForwardRequest):
    pool = ChannelPool(64 * 1024 * 1024)
    try:
        return await pool.unary(endpoint, "forward", request, timeout_s=30)
    finally:
        await pool.close()


def _hidden(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize(
    "hidden, extra, error, words",
    [
        (_hidden(1, 3, HIDDEN_SIZE + 1), {}, BadRequestError, "hidden size 65"),
        (_hidden(1, 3, HIDDEN_SIZE, dtype=torch.float64), {}, BadRequestError, "dtype torch.float64"),
        (_hidden(3, HIDDEN_SIZE), {}, BadRequestError, "[batch, seq, hidden]"),
        (_hidden(1, 0, HIDDEN_SIZE), {}, BadRequestError, "at least one"),
        (torch.full((1, 3, HIDDEN_SIZE), float("nan")), {}, BadRequestError, "NaN"),
        (torch.full((1, 3, HIDDEN_SIZE), float("inf")), {}, BadRequestError, "NaN or inf"),
        (_hidden(2, 3, HIDDEN_SIZE), {"attention_mask": torch.ones(2, 4, dtype=torch.int64)}, BadRequestError,
         "attention_mask must have shape [2, 3]"),
        (_hidden(1, 3, HIDDEN_SIZE), {"attention_mask": torch.full((1, 3), 2)}, BadRequestError, "0 or 1"),
        (_hidden(1, 3, HIDDEN_SIZE), {"position_ids": torch.tensor([[0, 1, 9999]])}, BadRequestError, "position_ids"),
        (_hidden(4, 300, HIDDEN_SIZE), {}, MessageTooLargeError, "larger than"),
    ],
    ids=["hidden-size", "dtype", "rank", "empty", "nan", "inf", "mask-shape", "mask-values", "positions", "too-large"],
)
def test_bad_forward_gets_typed_error(peer, hidden, extra, error, words):
    endpoint, prefix, _ = peer
    request = pb.ForwardRequest(span=_span(prefix), hidden_states=encode_tensor(hidden),
                                **{k: encode_tensor(v) for k, v in extra.items()})
    with pytest.raises(error) as caught:
        run(_forward(endpoint, request))
    assert words in str(caught.value)


def test_forward_with_payload_matches_local_span(peer):
    """Hidden states large enough to travel in the payload (see protocol/packing.py) come back exact."""
    endpoint, prefix, span = peer
    hidden = _hidden(2, 160, HIDDEN_SIZE)
    packer = Packer()
    request = packer.pack(pb.ForwardRequest(span=_span(prefix), hidden_states=packer.tensor(hidden)))
    assert request.message.hidden_states.in_payload
    received = run(_forward(endpoint, request))
    assert received.message.hidden_states.in_payload
    with torch.inference_mode():
        expected = span(hidden)
    got = decode_tensor(received.message.hidden_states, "hidden_states", received.payload)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_payload_reference_past_the_payload_is_bad_request(peer):
    endpoint, prefix, _ = peer
    request = pb.ForwardRequest(span=_span(prefix), payload=b"\0" * 64, hidden_states=pb.Tensor(
        shape=[1, 2, HIDDEN_SIZE], dtype="float32", in_payload=True, offset=32))
    with pytest.raises(BadRequestError, match="hidden_states: shape .* at offset 32 of the payload, which has 64"):
        run(_forward(endpoint, request))


def test_wrong_span_and_model(peer):
    endpoint, prefix, _ = peer
    hidden = encode_tensor(_hidden(1, 2, HIDDEN_SIZE))
    with pytest.raises(WrongSpanError, match="serves blocks 0:4, not 2:6"):
        run(_forward(endpoint, pb.ForwardRequest(span=_span(prefix, 2, 6), hidden_states=hidden)))
    with pytest.raises(WrongSpanError, match="not 'other-model'"):
        run(_forward(endpoint, pb.ForwardRequest(span=pb.Span(model="other-model", start=0, end=4),
                                                 hidden_states=hidden)))


def test_backward_checks_gradient_shape(peer):
    endpoint, prefix, _ = peer
    request = pb.BackwardRequest(span=_span(prefix), hidden_states=encode_tensor(_hidden(1, 3, HIDDEN_SIZE)),
                                 grad_outputs=encode_tensor(_hidden(1, 2, HIDDEN_SIZE)))
    pool = ChannelPool(1 << 26)

    async def go():
        try:
            await pool.unary(endpoint, "backward", request, timeout_s=30)
        finally:
            await pool.close()

    with pytest.raises(BadRequestError, match="grad_outputs has shape"):
        run(go())


def _open(prefix: str, session_id: str, max_length: int, batch: int = 1) -> pb.InferenceRequest:
    return pb.InferenceRequest(open=pb.OpenSession(span=_span(prefix), session_id=session_id,
                                                   max_length=max_length, batch_size=batch))


def _step(session_id: str, hidden: torch.Tensor, prefix_length: int) -> pb.InferenceRequest:
    positions = torch.arange(prefix_length, prefix_length + hidden.shape[1]).unsqueeze(0)
    return pb.InferenceRequest(step=pb.InferenceStep(session_id=session_id, hidden_states=encode_tensor(hidden),
                                                     position_ids=encode_tensor(positions),
                                                     prefix_length=prefix_length))


def test_step_that_rewinds_the_cache_matches_local(peer):
    """A step at a prefix shorter than the cache (a retried step, or a branch) forgets what followed it."""
    endpoint, prefix, span = peer
    tokens, branch = _hidden(1, 8, HIDDEN_SIZE), _hidden(1, 2, HIDDEN_SIZE)
    with torch.no_grad():
        expected = span(torch.cat([tokens[:, :5], branch], dim=1))[:, 5:]

    async def go():
        pool = ChannelPool(1 << 26)
        stream = InferenceStream(pool, endpoint)
        try:
            await stream.request(_open(prefix, "rewinds", max_length=16), 30)
            await stream.request(_step("rewinds", tokens[:, :5], 0), 30)
            await stream.request(_step("rewinds", tokens[:, 5:], 5), 30)
            response = await stream.request(_step("rewinds", branch, 5), 30)
            return response.message.step
        finally:
            await stream.close()
            await pool.close()

    step = run(go())
    assert step.position == 7
    torch.testing.assert_close(decode_tensor(step.hidden_states), expected, atol=1e-5, rtol=0)


def test_bad_steps_do_not_disturb_the_session_or_others(peer):
    """Session A runs a whole sequence while session B sends every kind of bad step; A's result is exact."""
    endpoint, prefix, span = peer
    tokens = _hidden(1, 12, HIDDEN_SIZE)
    with torch.no_grad():
        expected = span(tokens)

    async def go():
        pool = ChannelPool(1 << 26)
        a, b = InferenceStream(pool, endpoint), InferenceStream(pool, endpoint)
        try:
            await a.request(_open(prefix, "session-a", max_length=16), 30)
            await b.request(_open(prefix, "session-b", max_length=8), 30)
            outputs = [await a.request(_step("session-a", tokens[:, :5], 0), 30)]
            bad = [
                (_step("no-such-session", _hidden(1, 1, HIDDEN_SIZE), 0), UnknownSessionError, "unknown session"),
                (_step("session-b", _hidden(1, 9, HIDDEN_SIZE), 0), SequenceTooLongError, "max_length 8"),
                (_step("session-b", _hidden(2, 1, HIDDEN_SIZE), 0), BadRequestError, "batch 1, got batch 2"),
                (_step("session-b", torch.full((1, 1, HIDDEN_SIZE), float("nan")), 0), BadRequestError, "NaN"),
                (_step("session-b", _hidden(1, 1, HIDDEN_SIZE), 3), BadRequestError, "cache holds 0"),
                (_open(prefix, "session-c", 4), BadRequestError, "already open on this stream"),
                (_open(prefix, "session-a", 4), BadRequestError, "already open"),
            ]
            for request, error, words in bad:
                with pytest.raises(error, match=words):
                    await b.request(request, 30)
                outputs.append(await a.request(_step("session-a", tokens[:, len(outputs) + 4 : len(outputs) + 5],
                                                     len(outputs) + 4), 30))
            # B is still usable after all that
            await b.request(_step("session-b", _hidden(1, 2, HIDDEN_SIZE), 0), 30)
            return outputs
        finally:
            await a.close()
            await b.close()
            await pool.close()

    outputs = run(go())
    got = torch.cat([decode_tensor(o.message.step.hidden_states, "hidden_states", o.payload) for o in outputs], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_cache_budget_is_enforced_with_a_timeout(peer):
    endpoint, prefix, _ = peer

    async def go():
        pool = ChannelPool(1 << 26)
        first, second, third = (InferenceStream(pool, endpoint) for _ in range(3))
        try:
            with pytest.raises(CacheFullError, match="whole budget is 96"):
                await first.request(_open(prefix, "huge", max_length=200), 30)
            await second.request(_open(prefix, "holds-64", max_length=64), 30)
            with pytest.raises(CacheFullError, match="after waiting 0.5s"):
                await third.request(_open(prefix, "waits", max_length=64), 30)
            await second.close()  # frees its 64 tokens
            await asyncio.sleep(0.5)
            fourth = InferenceStream(pool, endpoint)
            await fourth.request(_open(prefix, "fits-now", max_length=64), 30)
            await fourth.close()
        finally:
            for stream in (first, second, third):
                await stream.close()
            await pool.close()

    run(go())


def test_cache_of_a_killed_client_is_freed(peer, tmp_path):
    """A client process that dies (SIGKILL) mid-session: its stream breaks and the peer frees its cache."""
    import subprocess
    import sys

    endpoint, prefix, _ = peer
    script = tmp_path / "doomed_client.py"
    script.write_text(f"""
import asyncio, sys
from client.transport import ChannelPool, InferenceStream
from protocol import swarmlm_pb2 as pb

async def main():
    stream = InferenceStream(ChannelPool(1 << 26), {endpoint!r})
    await stream.request(pb.InferenceRequest(open=pb.OpenSession(
        span=pb.Span(model={prefix!r}, start=0, end=4), session_id="doomed", max_length=64, batch_size=1)), 30)
    print("opened", flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
""")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "opened"

        async def open_64(session_id: str, timeout_s: float):
            pool = ChannelPool(1 << 26)
            stream = InferenceStream(pool, endpoint)
            try:
                request = _open(prefix, session_id, max_length=64)
                request.open.alloc_timeout_s = timeout_s
                await stream.request(request, 30)
            finally:
                await stream.close()
                await pool.close()

        with pytest.raises(CacheFullError):  # the live client holds 64 of the 96 tokens
            run(open_64("while-alive", 0.5))
        child.kill()
        child.wait(10)
        run(open_64("after-death", 10.0))  # waits (bounded) until the dead client's cache is freed
    finally:
        child.kill()
        child.wait(10)
