"""The peer's one compute thread: inference steps go ahead of forward/backward (training) work.

Work waits in a priority queue. A long forward or backward calls `checkpoint()` between its layers, which
runs any inference steps queued meanwhile right there, on the same thread: a heavy training request delays
a decode step by about one layer, not by its whole length. Work whose caller went away (its RPC was
cancelled, the client vanished) is dropped if it has not started, and stopped at its next layer if it has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

INFERENCE, TRAINING = 0, 1  # lower runs first


class Abandoned(Exception):
    """The caller of a running computation went away; it stops at its next checkpoint."""


@dataclass(order=True)
class _Work:
    priority: int
    seq: int
    fn: Callable[[], Any] = field(compare=False)
    future: concurrent.futures.Future = field(compare=False, default_factory=concurrent.futures.Future)
    abandoned: bool = field(compare=False, default=False)


class ComputeQueue:
    """One worker thread running submitted functions by priority, then in order of submission."""

    def __init__(self, name: str = "compute"):
        self._queue: list[_Work] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._current: _Work | None = None
        self._closed = False
        self.abandoned = 0  # works dropped before they started or stopped at a checkpoint: their callers left
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def run(self, fn: Callable[[], Any], priority: int = TRAINING) -> Any:
        """Run `fn` on the compute thread; if the awaiting task is cancelled, so is the work."""
        work = _Work(priority, next(self._order), fn)
        with self._ready:
            if self._closed:
                raise RuntimeError("the compute thread has stopped")
            heapq.heappush(self._queue, work)
            self._ready.notify()
        try:
            return await asyncio.wrap_future(work.future)
        except asyncio.CancelledError:
            work.abandoned = True  # not started: skipped; running: stops at its next checkpoint
            raise

    def checkpoint(self) -> None:
        """Called by computations between layers, on the compute thread: stop abandoned work, let inference in."""
        work = self._current
        if work is None or threading.current_thread() is not self._thread:
            return  # computed inline, off the queue
        if work.abandoned:
            self.abandoned += 1
            raise Abandoned("its caller went away")
        if work.priority > INFERENCE:
            while True:
                with self._ready:
                    if not self._queue or self._queue[0].priority > INFERENCE:
                        break
                    urgent = heapq.heappop(self._queue)
                self._execute(urgent)
                self._current = work

    def close(self) -> None:
        """Stop the thread once the running work is done; queued work is cancelled."""
        with self._ready:
            self._closed = True
            for work in self._queue:
                work.future.cancel()
            self._queue.clear()
            self._ready.notify()

    def _serve(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                work = heapq.heappop(self._queue)
            self._execute(work)
            self._current = None

    def _execute(self, work: _Work) -> None:
        if work.abandoned or not work.future.set_running_or_notify_cancel():
            self.abandoned += work.abandoned
            return
        self._current = work
        try:
            result = work.fn()
        except BaseException as exc:  # handed to the caller, who reports it
            work.future.set_exception(exc)
        else:
            work.future.set_result(result)
