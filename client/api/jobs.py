"""Generations as jobs: admitted under a concurrency limit, run in worker threads, read from the event loop.

The client's steps block (they wait for peers), so each generation runs in a worker thread of a pool of
`max_concurrency` threads and hands its text to the event loop through an asyncio queue; the loop itself never
waits on the swarm. A job whose HTTP client went away is cancelled: its thread stops after the current step
and closes the inference session (generation.py), and only then does its slot free up. A generation that a check
caught a liar in (client/inference_checks.py) runs again from its prompt while none of its text was sent: a
whole answer holds its text until the end for that.

Admission is a bounded queue: up to `max_concurrency` jobs run, up to `max_queued` more wait in arrival
order, and a request beyond that is refused at once with 429 (OpenAI's clients retry 429 with back-off).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from client.api.errors import ApiError
from client.api.generation import Backend, Finish, GenerationParams, run_generation
from client.api.metrics import ApiMetrics
from protocol.errors import OutputRewoundError

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # a generation and its retries after checks caught liars; each liar is banned before the next


class ClientGone(Exception):
    """The HTTP client disconnected while its request was waiting or running."""


async def until_gone(awaitable, gone: asyncio.Event):
    """The result of `awaitable`, or ClientGone as soon as `gone` is set (the awaitable is then cancelled)."""
    task, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(gone.wait())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone()


_GONE = object()  # put in a job's events when its client disconnects


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Failed:
    error: BaseException


class Job:
    """One generation: events (Text, then a Finish or a Failed) arrive in `events` from its worker thread."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, params: GenerationParams, metrics: ApiMetrics, arrived_at: float
    ):
        self.loop, self.params, self.metrics, self.arrived_at = loop, params, metrics, arrived_at
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self._last_token_at: float | None = None
        self._sent = False  # text of this job reached the event loop (a streamed answer's client has it)

    def _post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop closed (server shutdown): nobody is reading any more
            self.cancel.set()

    def _send(self, text: str) -> None:
        self._sent = True
        self._post(Text(text))

    def _on_token(self) -> None:
        now = time.perf_counter()
        if self._last_token_at is None:
            self.metrics.time_to_first_token.observe(now - self.arrived_at)
        else:
            self.metrics.time_per_token.observe(now - self._last_token_at)
        self._last_token_at = now

    def run(self, backend: Backend) -> None:
        """The worker thread's part."""
        self.metrics.active.inc()
        self.metrics.prompt_tokens.inc(len(self.params.prompt_ids))
        try:
            finish = self._generate(backend)
        except BaseException as exc:  # handed to the request, which answers with it
            if not self.cancel.is_set():
                logger.warning("generation failed: %s: %s", type(exc).__name__, exc)
            self._post(Failed(exc))
            return
        finally:
            self.metrics.active.dec()
        self.metrics.completion_tokens.inc(finish.completion_tokens)
        if finish.reason == "cancelled":
            self.metrics.cancelled.inc()
        self._post(finish)

    def _generate(self, backend: Backend) -> Finish:
        """run_generation, again from the prompt when a check rewound it (a liar was caught and banned) before any
        of its text reached the client: always for a whole answer, whose text is held until the end."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            held: list[str] = []
            emit = self._send if self.params.stream else held.append
            try:
                finish = run_generation(backend, self.params, self.cancel, emit, self._on_token)
            except OutputRewoundError as exc:
                if self._sent or attempt == MAX_ATTEMPTS:
                    raise
                logger.warning("%s; generating the request again from its prompt", exc)
                continue
            for text in held:
                self._post(Text(text))
            return finish
        raise AssertionError("unreachable")

    def client_gone(self) -> None:
        """The HTTP client disconnected: stop the worker, and wake whoever waits for the next event."""
        self.cancel.set()
        self.events.put_nowait(_GONE)

    async def next_event(self) -> Text | Finish | Failed:
        """The next event; raises ClientGone once the client has disconnected."""
        event = await self.events.get()
        if event is _GONE:
            self.events.put_nowait(_GONE)  # for any later reader too
            raise ClientGone()
        return event


class JobRunner:
    """Admission (`max_concurrency` running, `max_queued` waiting, 429 beyond) and the worker threads."""

    def __init__(self, backend: Backend, metrics: ApiMetrics, max_concurrency: int, max_queued: int):
        self.backend, self.metrics = backend, metrics
        self.max_concurrency, self.max_queued = max_concurrency, max_queued
        self._executor = ThreadPoolExecutor(max_concurrency, thread_name_prefix="swarmlm-api-generation")
        self._running = 0
        self._waiting: list[asyncio.Future] = []  # in arrival order
        self._jobs: set[Job] = set()

    async def start(
        self, params: GenerationParams, gone: asyncio.Event, arrived_at: float, backend: Backend | None = None
    ) -> Job:
        """Admit and start a job on `backend` (None: the runner's); raises ApiError(429) when the queue is full,
        ClientGone if the caller left.

        Once started, the job hears of a disconnect through `gone` too (its `client_gone` is called).
        """
        if self._running >= self.max_concurrency:
            if len(self._waiting) >= self.max_queued:
                raise ApiError(
                    429,
                    f"the server is busy: {self._running} generations running (--max-concurrency "
                    f"{self.max_concurrency}) and {len(self._waiting)} waiting (--max-queued "
                    f"{self.max_queued}); retry later",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            self.metrics.queued.set(len(self._waiting))
            try:
                await until_gone(asyncio.shield(turn), gone)
            except BaseException:
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif turn.done() and not turn.cancelled():  # our turn came as we left: pass it on
                    self._release()
                raise
            finally:
                self.metrics.queued.set(len(self._waiting))
        else:
            self._running += 1
        loop = asyncio.get_running_loop()
        job = Job(loop, params, self.metrics, arrived_at)
        self._jobs.add(job)
        future = loop.run_in_executor(self._executor, job.run, backend or self.backend)
        future.add_done_callback(lambda _: (self._jobs.discard(job), self._release()))
        waiter = asyncio.ensure_future(gone.wait())  # per-token reads then need no race with `gone`
        waiter.add_done_callback(lambda w: None if w.cancelled() else job.client_gone())
        future.add_done_callback(lambda _: waiter.cancel())
        return job

    def _release(self) -> None:
        """A job ended: its slot goes to the first waiter, or back to the pool."""
        while self._waiting:
            turn = self._waiting.pop(0)
            if not turn.done():
                turn.set_result(None)  # the slot moves to the waiter: _running stays the same
                return
        self._running -= 1

    def shutdown(self) -> None:
        """Cancel every job and wait for the worker threads (each stops after its current step)."""
        for job in list(self._jobs):
            job.cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
