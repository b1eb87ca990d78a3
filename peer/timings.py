"""Where a peer's inference steps spend their time: phase timers summed since start, read through the Info RPC.

The phases of one step (peer/inference.py `InferenceStreams._step`):

    parse    from entering the handler until its inputs are decoded and checked
    wait     from then until its reply is packed, less its computation: admission, the batcher's gathering
             and the compute queue before it, and, for a step computed on the compute thread, its result's
             way back to the event loop
    compute  the span's forward. A batched forward of n steps adds duration / n to each of them, so that
             `compute_s` sums the durations of the forwards run (per step: the amortized cost, not a latency);
             the other n - 1 steps' shares count in none of a member's phases
    reply    packing the answer

What comes before the handler (gRPC, reading the request's bytes, the session's queue) is in none of them: a
client sees it as transport. Only answered steps count. A few `perf_counter()` calls per step, nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from protocol import swarmlm_pb2 as pb


class StepClock:
    """The phases of one step as it runs: `parsed()`, then computations, then `replying()`, then `replied()`."""

    __slots__ = ("_computing_s", "_mark", "compute_s", "parse_s", "reply_s", "wait_s")

    def __init__(self):
        self.parse_s = self.wait_s = self.compute_s = self.reply_s = 0.0
        self._computing_s = 0.0  # wall time of the computations, a shared batch's whole duration included
        self._mark = time.perf_counter()

    def _lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._mark = now - self._mark, now
        return elapsed

    def parsed(self) -> None:
        self.parse_s = self._lap()

    def computed(self, seconds: float, shared_by: int = 1) -> None:
        """A computation of `seconds` ran for this step, shared with `shared_by - 1` other steps."""
        self._computing_s += seconds
        self.compute_s += seconds / max(1, shared_by)

    def timed(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """`fn`, counting its run as this step's computation (it may run on another thread)."""

        def run():
            began = time.perf_counter()
            try:
                return fn()
            finally:
                self.computed(time.perf_counter() - began)

        return run

    def replying(self) -> None:
        self.wait_s = max(0.0, self._lap() - self._computing_s)

    def replied(self) -> None:
        self.reply_s = self._lap()


class StepTimings:
    """Seconds per phase summed over the answered steps, and their count."""

    __slots__ = ("compute_s", "parse_s", "reply_s", "steps", "wait_s")

    def __init__(self):
        self.steps = 0
        self.parse_s = self.wait_s = self.compute_s = self.reply_s = 0.0

    def add(self, clock: StepClock) -> None:
        self.steps += 1
        self.parse_s += clock.parse_s
        self.wait_s += clock.wait_s
        self.compute_s += clock.compute_s
        self.reply_s += clock.reply_s

    def message(self) -> pb.InfoResponse.StepTimings:
        return pb.InfoResponse.StepTimings(
            steps=self.steps, parse_s=self.parse_s, wait_s=self.wait_s, compute_s=self.compute_s, reply_s=self.reply_s
        )
