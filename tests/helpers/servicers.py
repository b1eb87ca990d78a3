"""A servicer of the Peer service on a real gRPC server at 127.0.0.1, and a client's pool of channels to it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from client.transport import ChannelPool
from protocol.service import make_generic_handler


@contextlib.asynccontextmanager
async def served(servicer, max_bytes: int = 1 << 26) -> AsyncIterator[tuple[str, ChannelPool]]:
    """Yield (endpoint, pool) while `servicer` answers there; both are stopped on the way out."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((make_generic_handler(servicer),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ChannelPool(max_bytes)
    try:
        yield f"127.0.0.1:{port}", pool
    finally:
        await pool.close()
        await server.stop(None)
