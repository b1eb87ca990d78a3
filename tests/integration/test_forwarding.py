"""Inference steps pushed from peer to peer (peer/forwarding.py) on live peer processes: a push needs the session's
token and goes through the same checks as a client's step, and a route whose middle peer is SIGKILLed mid-generation,
while its steps travel peer to peer over real gRPC channels, is repaired with identical outputs. When the client asks
for pushes and when not, and a push that fails, are tested on in-memory peers (tests/client/test_pushes.py).

Peers serve the tiny Llama as 0:2, 2:3 (twice: one is the spare) and 3:4: routes have three hops.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.transport import ChannelPool, InferenceStream
from peer.blocks import load_span
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadRequestError, UnknownSessionError
from protocol.records import prefix_for_model
from swarm.models.checkpoint import load_config
from tests.helpers.generation import ActAfter, assert_same_generation, generate_with_logits
from tests.helpers.models import HIDDEN_SIZE, VOCAB_SIZE
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm
from tests.helpers.requests import end_stream, hidden, open_request, step_request

SPANS = [(0, 2), (2, 3), (2, 3), (3, 4)]
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_path):
    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        peers = [swarm.start_peer(tiny_llama_path, "--blocks", f"{a}:{b}") for a, b in SPANS]
        prefix = prefix_for_model(str(tiny_llama_path))
        swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == len(SPANS), 120, "the peers to be ONLINE")
        local = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        yield swarm, peers, local, prefix


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB_SIZE, (1, length), generator=torch.Generator().manual_seed(seed))


def _connect(swarm, path, **options):
    return AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers, **options)


def _pushed(remote, peer_ids) -> dict[str, int]:
    """Steps each of `peer_ids` has pushed on to the next peer so far."""

    async def read():
        snapshot = await remote.sequence.snapshot(refresh=True)
        endpoints = {pid: snapshot.servers[pid].endpoint for pid in peer_ids}
        return {
            pid: (await remote.sequence.pool.unary(e, "info", pb.InfoRequest(), 10.0)).pushed_steps
            for pid, e in endpoints.items()
        }

    return remote._run(read())


def test_a_pushed_step_needs_the_sessions_token_and_is_checked_like_a_clients(served, tiny_llama_path):
    swarm, _peers, _local, prefix = served
    snapshot = swarm.snapshot(prefix, 4)
    ((_, info),) = [(pid, i) for pid, i in snapshot.online().items() if (i.start_block, i.end_block) == (3, 4)]
    span = load_span(
        Path(tiny_llama_path), load_config(Path(tiny_llama_path)), 3, 4, dtype=torch.float32, device=torch.device("cpu")
    )

    async def main():
        pool = ChannelPool(1 << 26)
        stream = InferenceStream(pool, info.endpoint)
        token = b"t" * 16
        opening = open_request(prefix, 4, "pushed-into", 8)
        opening.open.span.start = 3
        opening.open.push_token = token
        try:
            await stream.request(opening, TIMEOUT_S)
            good = hidden(1, 3, HIDDEN_SIZE, seed=4)

            def push(tensor, push_token=token, session_id="pushed-into"):
                step = step_request(session_id, tensor, 0).step
                return pool.unary(info.endpoint, "push", pb.PushRequest(push_token=push_token, step=step), TIMEOUT_S)

            with pytest.raises(UnknownSessionError, match="token"):
                await push(good, push_token=b"wrong" * 3)
            with pytest.raises(UnknownSessionError):
                await push(good, session_id="nobody")
            bad = good.clone()
            bad[0, 1, 5] = float("nan")
            await push(bad)  # taken; the session's stream says what was wrong with it
            with pytest.raises(BadRequestError, match="NaN"):
                await stream.receive(TIMEOUT_S)
            await push(good)
            answer = await stream.receive(TIMEOUT_S)
            out = decode_tensor(answer.message.step.hidden_states, "hidden_states", answer.payload)
            with torch.inference_mode():
                torch.testing.assert_close(out, span(good, None, None, span.new_cache(), 0), atol=1e-5, rtol=0)
            # a client step on the same session goes on from there
            answer = await stream.request(step_request("pushed-into", hidden(1, 1, HIDDEN_SIZE, seed=5), 3), TIMEOUT_S)
            assert answer.message.step.position == 4
        finally:
            await end_stream(stream, TIMEOUT_S)
            await pool.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_middle_peer_of_a_forwarding_route_dies_and_the_outputs_do_not_change(served, tiny_llama_path):
    swarm, peers, local, prefix = served
    ids = _ids(5, seed=2)
    expected = generate_with_logits(local, ids, max_new_tokens=30, do_sample=False)
    remote = _connect(swarm, tiny_llama_path, forward_steps=True)
    killed = []

    def kill_middle(session):
        (middle,) = [s for s in session.remote.spans if (s.hop.start, s.hop.end) == (2, 3)]
        endpoint = swarm.snapshot(prefix, 4).servers[middle.hop.peer_id].endpoint
        killed.append(process_serving(peers, endpoint))
        swarm.kill(killed[0])

    try:
        before = _pushed(remote, swarm.snapshot(prefix, 4).online())
        with remote.inference_session(max_length=40) as session:
            streamer = ActAfter(12, lambda: kill_middle(session))
            got = generate_with_logits(remote, ids, max_new_tokens=30, do_sample=False, streamer=streamer)
            assert streamer.acted and session.recoveries >= 1
            assert [(s.hop.start, s.hop.end) for s in session.remote.spans] == [(0, 2), (2, 3), (3, 4)]
            first, spare, _ = [s.hop.peer_id for s in session.remote.spans]
        after = _pushed(remote, [first, spare])
        # the steps went 0:2 -> 2:3 -> 3:4 before the kill, and on through the spare after it
        assert after[first] - before[first] >= 12 and after[spare] - before[spare] > 0, (before, after)
        assert_same_generation(got, expected)
    finally:
        remote.shutdown()
