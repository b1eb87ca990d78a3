"""Finding the process behind a peer the client routed to."""

from __future__ import annotations

from collections.abc import Iterable

import psutil

from tests.helpers.processes import ManagedProcess


def process_serving(processes: Iterable[ManagedProcess], endpoint: str) -> ManagedProcess:
    """The process that listens on `endpoint` ("host:port"), the gRPC endpoint a peer announces."""
    port = int(endpoint.rsplit(":", 1)[1])
    for proc in processes:
        try:
            connections = psutil.Process(proc.pid).net_connections("tcp")
        except psutil.NoSuchProcess:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections):
            return proc
    raise AssertionError(f"no process of ours listens on {endpoint}")
