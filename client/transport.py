"""gRPC channels to peers, and calls that turn every failure into a swarmlm error.

A peer's address is its gRPC "host:port", or "p2p:..." for one reached through libp2p streams: its channel then
goes to a local endpoint of a `swarm.tunnel.TunnelPool`, the same gRPC calls through another path.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import grpc

from protocol.errors import PeerUnavailableError, SwarmError, error_from_code
from protocol.packing import Received
from protocol.service import PeerStub, error_from_rpc
from swarm.tunnel import TunnelPool, is_tunnel

logger = logging.getLogger(__name__)


class ChannelPool:
    """One channel per peer endpoint, reused by every request. Lives on the client's event loop."""

    def __init__(self, max_message_bytes: int, tunnels: TunnelPool | None = None):
        self.tunnels = tunnels
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        self._stubs: dict[str, tuple[grpc.aio.Channel, PeerStub]] = {}
        self._dropped: weakref.WeakSet = weakref.WeakSet()  # channels closed under requests still in flight

    def stub(self, endpoint: str) -> PeerStub:
        """The stub of a direct endpoint, or of a "p2p:..." address that `stub_for` has opened already."""
        if endpoint not in self._stubs:
            if is_tunnel(endpoint):
                raise RuntimeError(f"{endpoint} needs `await stub_for(...)` first")
            self._open(endpoint, endpoint)
        return self._stubs[endpoint][1]

    async def stub_for(self, endpoint: str) -> PeerStub:
        """The stub of any address, starting the local end of its tunnel if it is reached through libp2p."""
        if endpoint not in self._stubs and is_tunnel(endpoint):
            if self.tunnels is None:
                raise PeerUnavailableError(f"peer {endpoint} is reached only through libp2p, which this client was "
                                           f"not given (no DHT node)")
            self._open(endpoint, await self.tunnels.local_endpoint(endpoint))
        return self.stub(endpoint)

    def _open(self, endpoint: str, target: str) -> None:
        channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stubs[endpoint] = (channel, PeerStub(channel))

    async def drop(self, endpoint: str) -> None:
        """Forget a channel (its peer failed), so the next request reconnects."""
        entry = self._stubs.pop(endpoint, None)
        if entry is not None:
            self._dropped.add(entry[0])
            await entry[0].close(grace=None)

    def explain(self, error: SwarmError, endpoint: str) -> SwarmError:
        """`error`, with why the libp2p stream failed when `endpoint` is reached through one and it did."""
        reason = self.tunnels.failures.get(endpoint) if self.tunnels is not None and is_tunnel(endpoint) else None
        if reason is None or not isinstance(error, PeerUnavailableError):
            return error
        return PeerUnavailableError(f"{error}; {reason}")

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close(grace=None)
        self._stubs.clear()
        if self.tunnels is not None:
            await self.tunnels.close()

    async def unary(self, endpoint: str, method: str, request, timeout_s: float):
        stub = await self.stub_for(endpoint)
        channel = self._stubs[endpoint][0]
        try:
            return await getattr(stub, method)(request, timeout=timeout_s)
        except asyncio.CancelledError:
            # closing a channel cancels its calls: when another request's failure closed it, this one failed too
            if channel in self._dropped:
                raise PeerUnavailableError(f"peer {endpoint} failed while this request was in flight") from None
            raise
        except grpc.RpcError as exc:
            raise self.explain(error_from_rpc(exc, endpoint), endpoint) from exc
        except grpc.aio.UsageError as exc:  # its channel was closed under it, after another request failed
            raise PeerUnavailableError(f"peer {endpoint}: {exc}") from exc


class InferenceStream:
    """One open inference session on one peer: send a request, read its answer."""

    def __init__(self, pool: ChannelPool, endpoint: str):
        self.pool, self.endpoint = pool, endpoint
        self._call = None  # opened with the first request: a tunnel's local end starts asynchronously
        self._closed = False

    async def request(self, request, timeout_s: float) -> Received:
        """Send an InferenceRequest (or its `Packed` form) and return the answer with its payload."""
        try:
            response = await asyncio.wait_for(self._exchange(request), timeout_s)
        except asyncio.TimeoutError:
            raise PeerUnavailableError(f"peer {self.endpoint} did not answer within {timeout_s:.1f}s") from None
        except grpc.RpcError as exc:
            raise self.pool.explain(error_from_rpc(exc, self.endpoint), self.endpoint) from exc
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # the call or its channel already ended
            raise PeerUnavailableError(f"peer {self.endpoint} ended the inference stream: {exc}") from exc
        if response is grpc.aio.EOF:
            raise PeerUnavailableError(f"peer {self.endpoint} closed the inference stream")
        if response.message.WhichOneof("kind") == "error":
            error = response.message.error
            raise error_from_code(error.code, f"peer {self.endpoint}: {error.message}")
        return response

    async def _exchange(self, request):
        if self._call is None:
            if self._closed:
                raise PeerUnavailableError(f"peer {self.endpoint}: the inference stream is closed")
            self._call = (await self.pool.stub_for(self.endpoint)).inference()
        await self._call.write(request)
        return await self._call.read()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._call is None:
            return
        try:
            await asyncio.wait_for(self._call.done_writing(), 1.0)
        except (grpc.RpcError, asyncio.TimeoutError, SwarmError, RuntimeError):
            pass
        self._call.cancel()
