"""gRPC through libp2p streams: how clients reach a peer that they cannot connect to.

Every peer serves `TUNNEL_PROTOCOL` on its DHT node's libp2p daemon: each stream opened to it is spliced to a new
TCP connection to the peer's own gRPC server. A client reaches such a peer through a local TCP listener
(`TunnelPool`): each connection gRPC opens to it becomes one libp2p stream, straight to the peer or through a
relay (swarm/net/relay.py). So the Peer service, its messages, limits and errors are the same over both paths, and one
HTTP/2 connection (one stream) carries all the calls of a channel; libp2p streams have no message size limit.

A peer's address on this path is "p2p:<peer id>", or "p2p:<peer id>@<relay peer id>" through a relay.

Bounds, so that identities (free) cannot exhaust a peer's sockets: a peer takes at most MAX_TUNNELS_PER_SOURCE
tunnel streams from one remote peer and MAX_TUNNELS in all (beyond, a stream is closed at once); a stream whose
first bytes do not come within OPEN_TIMEOUT_S is closed before any connection is made for it; and a spliced stream
that carries nothing either way for IDLE_S is closed (gRPC opens a new one when its channel is used again).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import struct
import time
from collections.abc import Awaitable, Callable

import hivemind
from hivemind.p2p import PeerID

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, PeerUnavailableError, error_from_code

logger = logging.getLogger(__name__)

TUNNEL_PROTOCOL = "/swarmlm/1/tunnel"
RELAY_PROTOCOL = "/swarmlm/1/relay"  # a stream to a relay, forwarded to a peer's tunnel (swarm/net/relay.py)
TUNNEL_PREFIX = "p2p:"
CHUNK_BYTES = 256 * 1024
CONTROL_MAX_BYTES = 4096  # control messages (probe, relay registration and opening) are tiny
OPEN_TIMEOUT_S = 10.0
RELAY_TRIES = 2  # streams opened to a relay for one tunnel, when one ends before the relay's answer
MAX_TUNNELS = 512
MAX_TUNNELS_PER_SOURCE = (
    64  # a client's channel needs one; a relay carries many clients' (as many as it takes per peer)
)
IDLE_S = 600.0  # longer than a peer's idle session timeout (300 s), so that no idle session loses its stream
_LENGTH = struct.Struct(">I")
STREAM_ENDED = (asyncio.IncompleteReadError, ConnectionError)  # what read_message's "the stream ended" comes from


# --- addresses ---


def tunnel_address(peer_id: str, relay: str | None = None) -> str:
    return f"{TUNNEL_PREFIX}{peer_id}" + (f"@{relay}" if relay else "")


def is_tunnel(address: str) -> bool:
    return address.startswith(TUNNEL_PREFIX)


def describe_address(address: str) -> str:
    """How a client reaches a peer at `address`, for people: "gRPC at host:port", "libp2p" or "libp2p via relay X"."""
    if not is_tunnel(address):
        return f"gRPC at {address}"
    _, _, relay = address.removeprefix(TUNNEL_PREFIX).partition("@")
    return f"libp2p via relay {relay}" if relay else "libp2p"


def parse_tunnel_address(address: str) -> tuple[PeerID, PeerID | None]:
    """(peer, relay or None) of a "p2p:..." address."""
    peer, _, relay = address.removeprefix(TUNNEL_PREFIX).partition("@")
    try:
        return PeerID.from_base58(peer), PeerID.from_base58(relay) if relay else None
    except Exception as exc:  # base58 or multihash errors
        raise PeerUnavailableError(f"{address!r} is not a libp2p address of a peer") from exc


# --- bytes between two streams ---


def loopback_source(peer: PeerID) -> str:
    """An address in 127.0.0.0/8 (all of it is loopback on Linux) that stands for `peer`."""
    digest = hashlib.blake2b(peer.to_bytes(), digest_size=3).digest()
    return "127." + ".".join(str(byte) for byte in digest[:2]) + f".{max(2, digest[2])}"


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: list[float] | None = None) -> None:
    """Copy `reader` into `writer` until it ends; then end `writer` too. `activity[0]` is set at each chunk."""
    try:
        while data := await reader.read(CHUNK_BYTES):
            if activity is not None:
                activity[0] = time.monotonic()
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    idle_s: float = IDLE_S,
) -> None:
    """Carry bytes both ways between two streams until one side is done with both directions or breaks, or
    nothing passed either way for `idle_s`."""
    activity = [time.monotonic()]
    pipes = asyncio.ensure_future(asyncio.gather(pipe(a[0], b[1], activity), pipe(b[0], a[1], activity)))
    try:
        while not pipes.done():
            quiet = time.monotonic() - activity[0]
            if quiet >= idle_s:
                logger.debug("a spliced stream carried nothing for %.0fs; closing it", quiet)
                break
            await asyncio.wait([pipes], timeout=idle_s - quiet)
    finally:
        pipes.cancel()
        for writer in (a[1], b[1]):
            writer.close()


# --- control messages: a 4-byte length, then a protobuf message ---


async def write_message(writer: asyncio.StreamWriter, message) -> None:
    data = message.SerializeToString()
    writer.write(_LENGTH.pack(len(data)) + data)
    await writer.drain()


async def read_message(reader: asyncio.StreamReader, cls, *, timeout_s: float = OPEN_TIMEOUT_S):
    """The next control message, bounded in size and time; BadRequestError if it is not one."""
    try:
        (length,) = _LENGTH.unpack(await asyncio.wait_for(reader.readexactly(_LENGTH.size), timeout_s))
        if length > CONTROL_MAX_BYTES:
            raise BadRequestError(f"a {cls.__name__} of {length} bytes; the limit is {CONTROL_MAX_BYTES}")
        data = await asyncio.wait_for(reader.readexactly(length), timeout_s)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise BadRequestError(f"the stream ended before a whole {cls.__name__}") from exc
    except asyncio.TimeoutError:
        raise BadRequestError(f"no {cls.__name__} within {timeout_s:g}s") from None
    try:
        return cls.FromString(data)
    except Exception as exc:  # protobuf's DecodeError
        raise BadRequestError(f"not a {cls.__name__}: {exc}") from exc


# --- the peer's side ---


class TunnelServer:
    """Splices every tunnel stream opened to `p2p` to a new connection to the gRPC server at `endpoint`."""

    def __init__(
        self,
        p2p: hivemind.P2P,
        endpoint: str,
        *,
        max_streams: int = MAX_TUNNELS,
        max_per_source: int = MAX_TUNNELS_PER_SOURCE,
        idle_s: float = IDLE_S,
        first_bytes_s: float = OPEN_TIMEOUT_S,
    ):
        self.p2p, self.endpoint = p2p, endpoint
        self.max_streams, self.max_per_source, self.idle_s = max_streams, max_per_source, idle_s
        self.first_bytes_s = first_bytes_s
        self._tasks: set[asyncio.Task] = set()
        self._by_source: dict[PeerID, int] = {}
        self.refused = 0  # streams closed at once: over a cap, or silent past OPEN_TIMEOUT_S

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(TUNNEL_PROTOCOL, self._handle)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = info.peer_id
        if len(self._tasks) >= self.max_streams or self._by_source.get(source, 0) >= self.max_per_source:
            self.refused += 1
            writer.close()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        self._by_source[source] = self._by_source.get(source, 0) + 1
        try:
            try:  # nothing is opened for a stream that says nothing
                first = await asyncio.wait_for(reader.read(CHUNK_BYTES), self.first_bytes_s)
            except (asyncio.TimeoutError, ConnectionError, OSError):
                first = b""
            if not first:
                self.refused += 1
                writer.close()
                return
            host, _, port = self.endpoint.rpartition(":")
            # from an address of its own per remote peer, so that the gRPC server tells tunneled clients apart
            # (each client address has its own cache quota, peer/cache.py)
            local_addr = (loopback_source(info.peer_id), 0) if host.startswith("127.") else None
            try:
                local = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port), local_addr=local_addr), OPEN_TIMEOUT_S
                )
            except OSError:  # a system where only 127.0.0.1 is loopback: tunneled clients share one quota
                local = await asyncio.wait_for(asyncio.open_connection(host, int(port)), OPEN_TIMEOUT_S)
            local[1].write(first)
            await splice((reader, writer), local, self.idle_s)
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("a tunnel from %s could not reach this peer's gRPC server: %r", info.peer_id, exc)
            writer.close()
        finally:
            self._tasks.discard(task)
            self._by_source[source] -= 1
            if not self._by_source[source]:
                del self._by_source[source]

    @property
    def active(self) -> int:
        """Tunnel streams open now."""
        return len(self._tasks)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):  # the daemon may be gone already
            await self.p2p.remove_binary_stream_handler(TUNNEL_PROTOCOL)
        for task in list(self._tasks):
            task.cancel()


# --- the client's side ---


async def open_tunnel(p2p: hivemind.P2P, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A libp2p stream that reaches the gRPC server of the peer at `address` ("p2p:..."), maybe through its relay.

    Raises:
        PeerUnavailableError: the peer (or its relay) could not be reached, or the relay refused.
    """
    peer, relay = parse_tunnel_address(address)
    if relay is None:
        return await _open_stream(p2p, peer, TUNNEL_PROTOCOL, address)
    tries = 1
    while True:
        reader, writer = await _open_stream(p2p, relay, RELAY_PROTOCOL, address)
        try:
            await write_message(writer, pb.RelayOpen(peer_id=peer.to_base58()))
            opened = await read_message(reader, pb.RelayOpened)
        except (BadRequestError, ConnectionError, OSError) as exc:
            writer.close()
            # a stream that ended before any answer, the relay's refusal included, broke on its way (a run of the
            # suite under load saw one, cause not found): one more is tried; a relay that stays silent is not
            ended = isinstance(exc, (ConnectionError, OSError)) or isinstance(exc.__cause__, STREAM_ENDED)
            if ended and tries < RELAY_TRIES:
                tries += 1
                logger.debug("%s: the relay's stream ended before its answer; opening another", address)
                continue
            raise PeerUnavailableError(f"{address}: the relay did not answer: {exc}") from exc
        if opened.HasField("error"):
            writer.close()
            raise error_from_code(opened.error.code, f"relay {relay}: {opened.error.message}")
        return reader, writer


async def _open_stream(
    p2p: hivemind.P2P, to: PeerID, protocol: str, address: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(to, protocol), OPEN_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise PeerUnavailableError(f"{address}: no libp2p stream within {OPEN_TIMEOUT_S:g}s") from None
    except Exception as exc:  # the daemon's ControlFailure: no route, dial failed, no such protocol
        raise PeerUnavailableError(f"{address}: cannot open a libp2p stream: {exc}") from exc
    return reader, writer


class TunnelPool:
    """Local gRPC endpoints ("127.0.0.1:port") for peers reached through libp2p; lives on the client's loop.

    One listener per address, at most `max_listeners`: records name any number of "p2p:" addresses, and a listener
    for each would hold a socket for good. Opening one more closes the least recently used listener (the streams
    it spliced go on; a channel that reconnects to it fails, and is opened again on a new one)."""

    def __init__(self, get_p2p: Callable[[], Awaitable[hivemind.P2P]], max_listeners: int = 64):
        if max_listeners < 1:
            raise ValueError(f"max_listeners must be >= 1, got {max_listeners}")
        self._get_p2p, self.max_listeners = get_p2p, max_listeners
        self._servers: collections.OrderedDict[str, tuple[asyncio.Server, str]] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self.failures: dict[str, str] = {}  # address -> why its latest stream could not be opened

    async def local_endpoint(self, address: str) -> str:
        """Where to point a gRPC channel for the peer at `address` ("p2p:..."); starts its listener once."""
        if address not in self._servers:
            parse_tunnel_address(address)  # a malformed address fails here, not on every connection
            p2p = await self._get_p2p()
            server = await asyncio.start_server(lambda r, w: self._connect(p2p, address, r, w), "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            if address in self._servers:  # another call opened it while this one awaited
                server.close()
                self._servers.move_to_end(address)
                return self._servers[address][1]
            while len(self._servers) >= self.max_listeners:
                _, (oldest, _) = self._servers.popitem(last=False)
                oldest.close()
            self._servers[address] = (server, f"127.0.0.1:{port}")
        self._servers.move_to_end(address)
        return self._servers[address][1]

    async def _connect(self, p2p, address: str, reader, writer) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            remote = await open_tunnel(p2p, address)
            self.failures.pop(address, None)
            await splice((reader, writer), remote)
        except PeerUnavailableError as exc:
            logger.info("%s", exc)
            self.failures[address] = str(exc)
            writer.close()  # gRPC sees the connection fail: UNAVAILABLE, a peer failure
        except asyncio.CancelledError:  # closing the pool: asyncio's server would log a cancelled callback
            writer.close()
        finally:
            self._tasks.discard(task)

    async def close(self) -> None:
        for server, _ in self._servers.values():
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._servers.clear()
