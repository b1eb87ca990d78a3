"""Living with hivemind's averager processes: calls into them that cannot hang, and processes that end with their parent."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Run in a child process's thread: exit the child once its parent is gone (SIGKILLed, crashed)."""
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(0)


def bounded_call(fn: Callable, process, timeout_s: float, stop: threading.Event, what: str):
    """Call `fn` (a blocking call into the hivemind `process`) and give up after `timeout_s`, once `stop` is
    set, or when the process is gone.

    hivemind's averager waits on its process without a timeout even before a step starts, and a process that
    died or was shut down never answers; the call runs on a daemon thread, so that one stuck for good holds up
    neither the caller nor the interpreter's exit.

    Raises:
        RuntimeError: `stop` was set, or the process is gone.
        TimeoutError: no answer within `timeout_s`.
    """
    result: Future = Future()

    def call() -> None:
        try:
            result.set_result(fn())
        except BaseException as exc:
            result.set_exception(exc)

    threading.Thread(target=call, name=what, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not result.done():
        if stop.is_set():
            raise RuntimeError(f"{what}: the training group is shutting down")
        if not process.is_alive():
            raise RuntimeError(f"{what}: its process ({type(process).__name__}) is gone")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g}s (is the DHT or averager process alive?)")
        wait([result], timeout=0.1)  # returns as soon as the call does
    return result.result()
