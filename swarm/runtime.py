"""Running a role's async main until SIGINT or SIGTERM, on uvloop where available."""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable, Callable


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
