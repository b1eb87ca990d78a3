"""Running a role's async main until SIGINT or SIGTERM, on uvloop where available; a timeout that keeps cancels."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`await asyncio.wait_for(awaitable, timeout_s)`, except that a cancellation is never lost.

    Before Python 3.12, wait_for returns the result when the awaitable finishes in the same loop iteration as the
    task is cancelled, and the task runs on as if never cancelled (a vanished client's generation went on).
    Raises asyncio.TimeoutError (TimeoutError) when the time is up.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout_s)  # 3.10 has no asyncio.timeout


_background: set[asyncio.Task] = set()


def in_background(awaitable: Awaitable) -> asyncio.Task:
    """Run `awaitable` as a task that nobody awaits, held until it ends: the loop keeps only weak references to
    tasks, so an unreferenced one may be garbage-collected mid-run."""
    task = asyncio.ensure_future(awaitable)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def install_event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:  # plain asyncio elsewhere
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def wait_for_signal() -> int:
    """Wait for SIGINT or SIGTERM; return the signal's number."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[int] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda s=sig: received.done() or received.set_result(s))
    try:
        return await received
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_until_signal(main: Callable[[], Awaitable[int]]) -> int:
    install_event_loop_policy()
    return asyncio.run(main())
