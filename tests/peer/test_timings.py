"""Phase timers of inference steps: the phases partition a step's time, a shared forward is split among its steps,
and the sums reach Info's message. Only lower bounds on sleeps are asserted: a loaded machine only adds time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from peer.compute import INFERENCE, ComputeQueue
from peer.timings import StepClock, StepTimings
from protocol import swarmlm_pb2 as pb

NAP_S = 0.01


def test_the_phases_of_a_step_partition_its_time():
    began = time.perf_counter()
    clock = StepClock()
    time.sleep(NAP_S)
    clock.parsed()
    time.sleep(NAP_S)  # waiting for the compute thread
    assert clock.timed(lambda: time.sleep(2 * NAP_S) or "out")() == "out"
    time.sleep(NAP_S)  # the result's way back
    clock.replying()
    time.sleep(NAP_S)
    clock.replied()
    elapsed = time.perf_counter() - began
    assert clock.parse_s >= NAP_S and clock.reply_s >= NAP_S
    assert clock.compute_s >= 2 * NAP_S
    assert clock.wait_s >= 2 * NAP_S
    total = clock.parse_s + clock.wait_s + clock.compute_s + clock.reply_s
    assert 6 * NAP_S <= total <= elapsed


def test_a_batched_forward_counts_once_over_its_steps():
    began = time.perf_counter()
    clock = StepClock()
    clock.parsed()
    time.sleep(3 * NAP_S)  # the whole batch's forward, shared by 3 steps
    clock.computed(3 * NAP_S, shared_by=3)
    clock.replying()
    clock.replied()
    elapsed = time.perf_counter() - began
    assert clock.compute_s == pytest.approx(NAP_S)
    # the wait excludes the whole forward, not only this step's share of it
    assert clock.parse_s + clock.wait_s + 3 * NAP_S + clock.reply_s <= elapsed + 1e-9


def test_a_failed_computation_still_counts_and_raises():
    clock = StepClock()

    def fails():
        time.sleep(NAP_S)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        clock.timed(fails)()
    assert clock.compute_s >= NAP_S


def test_time_queued_behind_other_work_on_the_compute_thread_is_wait():
    async def go():
        queue, busy, release = ComputeQueue(), threading.Event(), threading.Event()
        try:
            clock = StepClock()
            clock.parsed()
            blocker = asyncio.ensure_future(queue.run(lambda: busy.set() or release.wait(10.0), INFERENCE))
            await asyncio.to_thread(busy.wait, 10.0)
            step = asyncio.ensure_future(queue.run(clock.timed(lambda: time.sleep(NAP_S)), INFERENCE))
            await asyncio.sleep(10 * NAP_S)  # the step waits in the queue meanwhile
            release.set()
            await step
            await blocker
            clock.replying()
            clock.replied()
            return clock
        finally:
            queue.close()

    clock = asyncio.run(go())
    assert clock.compute_s >= NAP_S
    assert clock.wait_s >= 10 * NAP_S > clock.compute_s


def test_timings_sum_steps_into_info():
    timings = StepTimings()
    for parse in (0.001, 0.002):
        clock = StepClock()
        clock.parse_s, clock.wait_s, clock.compute_s, clock.reply_s = parse, 0.01, 0.1, 0.003
        timings.add(clock)
    answer = pb.InfoResponse.FromString(pb.InfoResponse(step_timings=timings.message()).SerializeToString())
    got = answer.step_timings
    assert got.steps == 2
    assert (got.parse_s, got.wait_s, got.compute_s, got.reply_s) == pytest.approx((0.003, 0.02, 0.2, 0.006))
