"""The LM head of concurrent generations, computed as one batch: one read of its weights for every row.

A client that serves many generations at once (`swarmlm api`, one thread per generation) would otherwise compute
each generation's head alone, one after the other. Here rows that reach the head while it computes a round are
computed together in the next one, which never makes a row wait longer than the round before it.

With `max_wait_s` > 0 a round also waits for the generations that are decoding (members) to hand in their hidden
states, for `max_wait_s` at most after the first one did, and releases them together, so that their next
steps reach the first peer together (lockstep). On 2 CPU cores shared by the client and three peers, 0.25-0.5 s
waits gave rounds of 5-7 rows of 8 but no larger batches on the peers nor more tokens/s (docs/performance.md),
and with generations on routes of different speeds it would hold the fast ones back, so the API does not wait.
A row computed in a batch may differ from the row computed alone in the last bits of float rounding, as the
peers' batched blocks do.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class _Request:
    hidden: torch.Tensor  # [rows, hidden]
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class HeadBatcher:
    """`head` maps hidden states [rows, hidden] to logits [rows, vocab]; callers are threads."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], max_wait_s: float = 0.0):
        if not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.head, self.max_wait_s = head, max_wait_s
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Request] = []
        self._round_began = 0.0  # when the first request of the pending round came
        self._computing = False
        self.rounds = 0  # batches computed, and the rows in them (for benchmarks)
        self.rows = 0

    @contextlib.contextmanager
    def member(self) -> Iterator[None]:
        """While inside, the caller is a decoding generation that each round waits for (within `max_wait_s`)."""
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                self._cond.notify_all()  # a round that waited for this member may be complete now

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits [rows, vocab] of `hidden` [rows, hidden], computed in this round's batch."""
        request = _Request(hidden)
        with self._cond:
            if not self._pending:
                self._round_began = time.monotonic()
            self._pending.append(request)
            self._cond.notify_all()
            while not request.done:
                wait = self._leader_wait(request)
                if wait is None:
                    self._compute_round()
                else:
                    self._cond.wait(wait)
        if request.error is not None:
            raise request.error
        return request.logits

    def _leader_wait(self, request: _Request) -> float | None:
        """None: `request` leads the pending round and it is complete; else how long to wait before looking again."""
        if self._computing or not self._pending or self._pending[0] is not request:
            return 1.0  # notified when its round is done or it leads the next; the timeout only in case
        left = self._round_began + self.max_wait_s - time.monotonic()
        if len(self._pending) >= self._members or left <= 0:
            return None
        return left

    def _compute_round(self) -> None:
        """Called with the lock held by the round's leader: computes the round without the lock."""
        batch, self._pending = self._pending, []
        self._computing = True
        self._cond.release()
        try:
            rows = [r.hidden.shape[0] for r in batch]
            try:
                with torch.inference_mode():
                    logits = self.head(torch.cat([r.hidden for r in batch]))
                for request, part in zip(batch, logits.split(rows)):
                    request.logits = part
            except BaseException as exc:  # every request of the round hears of it
                for request in batch:
                    request.error = exc
        finally:
            self._cond.acquire()
            self._computing = False
            self.rounds += 1
            self.rows += sum(r.hidden.shape[0] for r in batch)
            if self._pending:  # the next round's wait starts now: it could not be computed meanwhile
                self._round_began = time.monotonic()
            for request in batch:
                request.done = True
            self._cond.notify_all()
