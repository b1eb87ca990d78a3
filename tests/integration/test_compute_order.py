"""The compute thread of a live peer process: decode steps overtake queued training work, and work whose
client went away is dropped or stopped between layers. Outcomes are told by order and by the peer's own
counters (its Info call), never by how long something took.

Heavy work is a backward of 32 x 256 tokens through 4 layers (about 0.3 s here, 0.08 s a layer); a decode step
is one token.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from client.transport import ChannelPool, InferenceStream
from peer.blocks import load_span
from protocol import swarmlm_pb2 as pb
from protocol.records import prefix_for_model
from swarm.models.checkpoint import load_config
from tests.helpers.models import HIDDEN_SIZE, MAX_POSITIONS
from tests.helpers.requests import Witness, backward_request, end_stream, hidden

NUM_LAYERS = 4
HEAVY = 6  # backward requests queued at once
HEAVY_SHAPE = (32, MAX_POSITIONS, HIDDEN_SIZE)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def peer(tmp_path_factory, tiny_llama_path):
    from tests.helpers.processes import Swarm

    with Swarm(tmp_path_factory.mktemp("swarm")) as swarm:
        swarm.start_bootstrap()
        process = swarm.start_peer(
            tiny_llama_path,
            "--blocks",
            f"0:{NUM_LAYERS}",
            "--max-queued-tokens",
            str(4 * HEAVY * HEAVY_SHAPE[0] * HEAVY_SHAPE[1]),
        )
        prefix = prefix_for_model(str(tiny_llama_path))
        ((_, info),) = swarm.wait_online(prefix, [(0, NUM_LAYERS)]).online().items()
        span = load_span(
            Path(tiny_llama_path),
            load_config(Path(tiny_llama_path)),
            0,
            NUM_LAYERS,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        yield {"process": process, "prefix": prefix, "endpoint": info.endpoint, "span": span}


def run(peer, fn) -> None:
    async def main():
        pool = ChannelPool(1 << 28)
        witness = await Witness(
            InferenceStream(pool, peer["endpoint"]), peer["prefix"], peer["span"], timeout_s=TIMEOUT_S
        ).open()
        heavy: list[asyncio.Task] = []
        try:
            await witness.step()
            request = backward_request(peer["prefix"], NUM_LAYERS, hidden(*HEAVY_SHAPE))
            heavy = [
                asyncio.create_task(pool.unary(peer["endpoint"], "backward", request, TIMEOUT_S)) for _ in range(HEAVY)
            ]
            # once the first is answered the others have long been queued behind it
            await asyncio.wait(heavy, return_when=asyncio.FIRST_COMPLETED)
            await fn(pool, witness, heavy)
            assert peer["process"].alive(), f"the peer exited with {peer['process'].returncode}"
        finally:
            for task in heavy:
                task.cancel()
            await asyncio.gather(*heavy, return_exceptions=True)
            await end_stream(witness.stream, TIMEOUT_S)
            await pool.close()

    asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT_S))


async def info(pool: ChannelPool, endpoint: str) -> pb.InfoResponse:
    return await pool.unary(endpoint, "info", pb.InfoRequest(), TIMEOUT_S)


def test_decode_steps_go_ahead_of_queued_training_work(peer):
    async def fn(pool, witness, heavy):
        answered = sum(task.done() for task in heavy)
        assert answered <= 2, f"{answered} of {HEAVY} heavy requests were answered already: too little queued"
        for _ in range(3):
            await witness.step()  # exact, and each waits for at most the layer under way
        overtaken = sum(not task.done() for task in heavy)
        # computed in order of arrival, the first step would have waited for every heavy request
        assert overtaken >= HEAVY - answered - 2, (
            f"3 decode steps waited for {HEAVY - answered - overtaken} of {HEAVY - answered} heavy requests"
        )
        for result in await asyncio.gather(*heavy):
            assert list(result.message.grad_inputs.shape) == list(HEAVY_SHAPE)

    run(peer, fn)


def test_work_of_a_client_that_went_away_is_dropped(peer):
    async def fn(pool, witness, heavy):
        before = (await info(pool, peer["endpoint"])).abandoned_work
        left = [task for task in heavy if not task.done()]
        for task in left:
            task.cancel()  # the client gives up: gRPC cancels the calls
        await asyncio.gather(*left, return_exceptions=True)
        await witness.step()
        for _ in range(200):  # bounded: until the peer's queue is empty
            state = await info(pool, peer["endpoint"])
            if state.queued_work == 0:
                break
            await asyncio.sleep(0.05)
        assert state.queued_work == 0
        dropped = state.abandoned_work - before
        # the one under way stops at its next layer, the queued ones never start (one may finish meanwhile)
        assert dropped >= len(left) - 1, f"{dropped} of {len(left)} cancelled requests were dropped"
        await witness.step()
        result = await pool.unary(
            peer["endpoint"],
            "backward",
            backward_request(peer["prefix"], NUM_LAYERS, hidden(2, 8, HIDDEN_SIZE)),
            TIMEOUT_S,
        )
        assert list(result.message.grad_inputs.shape) == [2, 8, HIDDEN_SIZE]

    run(peer, fn)
