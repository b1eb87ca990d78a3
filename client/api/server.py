"""Serve an ASGI app with uvicorn in a background thread (benchmarks, tests, programs embedding the API)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serving_in_background(app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 20.0) -> Iterator[str]:
    """Serve `app` on host:port (0: a free port) while the block runs; yields the base URL (http://host:port).

    Raises:
        RuntimeError: the server did not start within `timeout_s`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="swarmlm-api-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server on {host}:{sock.getsockname()[1]} did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the API server thread did not stop within 30 s")
