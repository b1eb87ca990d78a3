"""A private asyncio loop in a daemon thread: the client's async core behind a blocking API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class BackgroundLoop:
    def __init__(self, name: str = "swarmlm-client"):
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:  # plain asyncio elsewhere
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; its future can be waited on, or cancelled, from any other thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.submit called from its own thread; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (its exception is re-raised here)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.run called from its own thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()
