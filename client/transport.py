"""gRPC channels to peers, and calls that turn every failure into a swarmlm error.

A peer's address is its gRPC "host:port", or "p2p:..." for one reached through libp2p streams: its channel then
goes to a local endpoint of a `swarm.net.tunnel.TunnelPool`, the same gRPC calls through another path.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import grpc

from protocol.errors import PeerUnavailableError, SwarmError, error_from_code
from protocol.packing import Received
from protocol.service import WINDOW_OPTIONS, PeerStub, error_from_rpc
from swarm.net.tunnel import TunnelPool, is_tunnel
from swarm.runtime import within
from swarm.trust.rpcauth import RpcAuth, call_metadata, open_channel
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)


class ChannelPool:
    """One channel per peer endpoint, reused by every request. Lives on the client's event loop.

    At most `max_channels` stay open: opening one more closes the least recently used channel that no call or
    inference stream is using (a busy one is never closed for room: the pool then holds more until calls end).
    With `swarm_key` (a private swarm) channels are TLS to a member of that swarm and every call carries its tag.
    `connect` opens each channel (`rpcauth.open_channel`); tests pass one to in-memory peers
    (tests/helpers/fake_swarm.py).
    """

    def __init__(
        self,
        max_message_bytes: int,
        tunnels: TunnelPool | None = None,
        max_channels: int = 64,
        swarm_key: SwarmKey | None = None,
        *,
        connect: Callable[[str, Sequence, RpcAuth | None], grpc.aio.Channel] = open_channel,
    ):
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.tunnels, self.max_channels, self._connect = tunnels, max_channels, connect
        self.auth = RpcAuth(swarm_key) if swarm_key is not None else None
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *WINDOW_OPTIONS,
        ]
        # least recently used first
        self._stubs: OrderedDict[str, tuple[grpc.aio.Channel, PeerStub]] = OrderedDict()
        self._users: Counter[str] = Counter()  # endpoint -> calls and streams on its channel now
        self._dropped: weakref.WeakSet = weakref.WeakSet()  # channels closed under requests still in flight

    @property
    def endpoints(self) -> list[str]:
        """Endpoints with an open channel, least recently used first."""
        return list(self._stubs)

    async def stub_for(self, endpoint: str) -> PeerStub:
        """The stub of any address, starting the local end of its tunnel if it is reached through libp2p."""
        if endpoint not in self._stubs:
            await self._make_room()
            target = endpoint
            if is_tunnel(endpoint):
                if self.tunnels is None:
                    raise PeerUnavailableError(
                        f"peer {endpoint} is reached only through libp2p, which this client was not given (no DHT node)"
                    )
                target = await self.tunnels.local_endpoint(endpoint)
            if endpoint not in self._stubs:  # another request may have opened it meanwhile
                channel = self._connect(target, self._options, self.auth)
                self._stubs[endpoint] = (channel, PeerStub(channel))
        self._stubs.move_to_end(endpoint)
        return self._stubs[endpoint][1]

    async def _make_room(self) -> None:
        while len(self._stubs) >= self.max_channels:
            idle = next((endpoint for endpoint in self._stubs if not self._users[endpoint]), None)
            if idle is None:
                logger.debug("all %d channels are in use; opening one more", len(self._stubs))
                return
            channel, _ = self._stubs.pop(idle)
            await channel.close(grace=None)

    def hold(self, endpoint: str) -> None:
        """Count a user of `endpoint`'s channel (an open stream), so that it is not closed for room."""
        self._users[endpoint] += 1

    def release(self, endpoint: str) -> None:
        self._users[endpoint] -= 1
        if self._users[endpoint] <= 0:
            del self._users[endpoint]

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
        self.hold(endpoint)
        try:
            return await getattr(stub, method)(request, timeout=timeout_s, metadata=call_metadata(self.auth, method))
        except asyncio.CancelledError:
            # closing a channel cancels its calls: when another request's failure closed it, this one failed too
            if channel in self._dropped:
                raise PeerUnavailableError(f"peer {endpoint} failed while this request was in flight") from None
            raise
        except grpc.RpcError as exc:
            raise self.explain(error_from_rpc(exc, endpoint), endpoint) from exc
        except grpc.aio.UsageError as exc:  # its channel was closed under it, after another request failed
            raise PeerUnavailableError(f"peer {endpoint}: {exc}") from exc
        finally:
            self.release(endpoint)


class InferenceStream:
    """One open inference session on one peer: send requests, read their answers in order.

    Answers are read by a task of the stream's own into a queue, so a caller may stop waiting for one (a
    timeout, a cancelled wait) without losing it.
    """

    def __init__(self, pool: ChannelPool, endpoint: str):
        self.pool, self.endpoint = pool, endpoint
        self._call = None  # opened with the first request: a tunnel's local end starts asynchronously
        self._closed = False
        self._answers: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    async def request(self, request, timeout_s: float) -> Received:
        """Send an InferenceRequest (or its `Packed` form) and return the answer with its payload."""
        try:
            await within(self.send(request), timeout_s)
        except asyncio.TimeoutError:
            raise PeerUnavailableError(f"peer {self.endpoint} did not take a request within {timeout_s:.1f}s") from None
        return await self.receive(timeout_s)

    async def send(self, request) -> None:
        try:
            if self._call is None:
                if self._closed:
                    raise PeerUnavailableError(f"peer {self.endpoint}: the inference stream is closed")
                self._call = (await self.pool.stub_for(self.endpoint)).inference(
                    metadata=call_metadata(self.pool.auth, "inference")
                )
                self.pool.hold(self.endpoint)  # until close(): the stream keeps its channel open
                self._reader = asyncio.ensure_future(self._read_all(self._call))
            await self._call.write(request)
        except grpc.RpcError as exc:
            raise self.pool.explain(error_from_rpc(exc, self.endpoint), self.endpoint) from exc
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # the call or its channel already ended
            raise PeerUnavailableError(f"peer {self.endpoint} ended the inference stream: {exc}") from exc

    async def _read_all(self, call) -> None:
        try:
            while True:
                response = await call.read()
                self._answers.put_nowait(response)
                if response is grpc.aio.EOF:
                    return
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._answers.put_nowait(exc)

    async def receive(self, timeout_s: float) -> Received:
        """The next answer on the stream (an `error` answer raised as its typed error)."""
        if self._reader is None:
            raise PeerUnavailableError(f"peer {self.endpoint}: nothing was sent on this inference stream")
        try:
            response = await within(self._answers.get(), timeout_s)
        except asyncio.TimeoutError:
            raise PeerUnavailableError(f"peer {self.endpoint} did not answer within {timeout_s:.1f}s") from None
        if isinstance(response, grpc.RpcError):
            raise self.pool.explain(error_from_rpc(response, self.endpoint), self.endpoint) from response
        if isinstance(response, (asyncio.InvalidStateError, grpc.aio.UsageError)):
            raise PeerUnavailableError(f"peer {self.endpoint} ended the inference stream: {response}") from response
        if isinstance(response, BaseException):
            raise response
        if response is grpc.aio.EOF:
            self._answers.put_nowait(response)  # and for every later wait
            raise PeerUnavailableError(f"peer {self.endpoint} closed the inference stream")
        if response.message.WhichOneof("kind") == "error":
            error = response.message.error
            raise error_from_code(error.code, f"peer {self.endpoint}: {error.message}")
        return response

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._call is None:
            return
        self.pool.release(self.endpoint)
        try:
            await asyncio.wait_for(self._call.done_writing(), 1.0)
        except (grpc.RpcError, asyncio.TimeoutError, SwarmError, RuntimeError):
            pass
        self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
