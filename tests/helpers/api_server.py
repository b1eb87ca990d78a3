"""An ASGI app served by uvicorn in a background thread on a free 127.0.0.1 port, stopped on the way out."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


@contextmanager
def serving(app, timeout_s: float = 20.0) -> Iterator[str]:
    """Serve `app`; yields its base URL (http://127.0.0.1:PORT). The server thread is joined afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="api-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the API server thread did not stop"
