"""The compute thread: inference ahead of training work, between layers too; abandoned work stops."""

from __future__ import annotations

import asyncio
import threading

import pytest

from peer.compute import INFERENCE, TRAINING, Abandoned, ComputeQueue

WAIT_S = 10.0


def test_inference_runs_between_the_layers_of_long_training_work():
    async def go():
        queue, order = ComputeQueue(), []
        started, let_go = threading.Event(), threading.Event()

        def training():
            order.append("training: layer 1")
            started.set()
            assert let_go.wait(WAIT_S)
            queue.checkpoint()  # between layers: queued inference runs here
            order.append("training: layer 2")
            return "trained"

        try:
            long = asyncio.ensure_future(queue.run(training, TRAINING))
            await asyncio.to_thread(started.wait, WAIT_S)
            later_training = asyncio.ensure_future(queue.run(lambda: order.append("training 2"), TRAINING))
            steps = [
                asyncio.ensure_future(queue.run(lambda i=i: order.append(f"step {i}") or i, INFERENCE))
                for i in range(3)
            ]
            await asyncio.sleep(0.05)  # let them queue
            let_go.set()
            assert await asyncio.wait_for(asyncio.gather(*steps), WAIT_S) == [0, 1, 2]
            assert await asyncio.wait_for(long, WAIT_S) == "trained"
            await asyncio.wait_for(later_training, WAIT_S)
            assert order == ["training: layer 1", "step 0", "step 1", "step 2", "training: layer 2", "training 2"]
        finally:
            queue.close()

    asyncio.run(go())


def test_abandoned_work_stops_at_its_next_checkpoint_and_queued_work_is_skipped():
    async def go():
        queue = ComputeQueue()
        started, let_go, stopped = threading.Event(), threading.Event(), threading.Event()
        ran = []

        def long():
            started.set()
            assert let_go.wait(WAIT_S)
            try:
                queue.checkpoint()
            except Abandoned:
                stopped.set()
                raise
            ran.append("long finished")

        try:
            task = asyncio.ensure_future(queue.run(long))
            await asyncio.to_thread(started.wait, WAIT_S)
            skipped = asyncio.ensure_future(queue.run(lambda: ran.append("skipped")))
            await asyncio.sleep(0.05)
            task.cancel()
            skipped.cancel()
            for cancelled in (task, skipped):
                with pytest.raises(asyncio.CancelledError):
                    await cancelled
            let_go.set()
            assert await asyncio.to_thread(stopped.wait, WAIT_S)
            assert await asyncio.wait_for(queue.run(lambda: "next"), WAIT_S) == "next"
            assert ran == []
        finally:
            queue.close()

    asyncio.run(go())


def test_errors_reach_the_caller_and_the_thread_goes_on():
    async def go():
        queue = ComputeQueue()
        try:
            with pytest.raises(ZeroDivisionError):
                await queue.run(lambda: 1 / 0)
            assert await queue.run(lambda: 2) == 2
            queue.checkpoint()  # off the compute thread: nothing to do
        finally:
            queue.close()
        with pytest.raises(RuntimeError, match="stopped"):
            await queue.run(lambda: 3)

    asyncio.run(go())
