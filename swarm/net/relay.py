"""Relays: public members of the swarm that forward libp2p streams to peers behind NAT.

A peer that nobody can connect to registers with a relay over the connection it opened to it itself
(`REGISTER_PROTOCOL`), and renews that before the registration runs out. A client reaches the peer by opening a
`RELAY_PROTOCOL` stream to the relay and naming the peer (RelayOpen); the relay opens a tunnel stream to the
peer over the peer's own connection and splices the two (swarm/net/tunnel.py). The bootstrap node relays by default,
and a public peer does with `--relay`.

A relay forwards only to peers registered with it, only to their tunnel, and within bounds on peers and
streams (in all, per peer, and per client that opens them), so it is no open proxy. It sees the bytes it carries,
as any proxy would.

libp2p's own circuit relay was tried first: its reservations (go-libp2p autorelay, in hivemind's p2pd) are made
only after a 3-minute boot delay when fewer than 4 relays are known, which is every small swarm, and the relay
service that p2pd starts on every node limits each relayed connection to 128 KiB by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import hivemind
from hivemind.p2p import PeerID

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, PeerUnavailableError, SwarmError
from swarm.net.tunnel import (
    OPEN_TIMEOUT_S,
    RELAY_PROTOCOL,
    RELAY_TRIES,
    STREAM_ENDED,
    TUNNEL_PROTOCOL,
    read_message,
    splice,
    write_message,
)

logger = logging.getLogger(__name__)

REGISTER_PROTOCOL = "/swarmlm/1/relay/register"
REGISTRATION_TTL_S = 60.0


def _error(error: SwarmError) -> pb.Error:
    return pb.Error(code=error.code, message=str(error))


class RelayService:
    """Forwards streams to the peers registered with it, on `p2p` (a replica of this process's DHT daemon)."""

    def __init__(
        self,
        p2p: hivemind.P2P,
        *,
        ttl_s: float = REGISTRATION_TTL_S,
        max_peers: int = 256,
        max_streams: int = 512,
        max_streams_per_peer: int = 64,
        max_streams_per_source: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.p2p, self.ttl_s, self.clock = p2p, ttl_s, clock
        self.max_peers, self.max_streams, self.max_streams_per_peer = max_peers, max_streams, max_streams_per_peer
        self.max_streams_per_source = max_streams_per_source
        self._expires: dict[PeerID, float] = {}
        self._streams: dict[PeerID, int] = {}
        self._sources: dict[PeerID, int] = {}  # streams open by each client of the relay
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(REGISTER_PROTOCOL, self._register)
        await self.p2p.add_binary_stream_handler(RELAY_PROTOCOL, self._relay)

    async def stop(self) -> None:
        for name in (REGISTER_PROTOCOL, RELAY_PROTOCOL):
            with contextlib.suppress(Exception):  # the daemon may be gone already
                await self.p2p.remove_binary_stream_handler(name)
        for task in list(self._tasks):
            task.cancel()

    def registered(self) -> list[PeerID]:
        now = self.clock()
        for peer in [peer for peer, expires in self._expires.items() if expires <= now]:
            del self._expires[peer]
        return list(self._expires)

    async def _register(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_message(reader, pb.RelayRegistration)
            peer = info.peer_id  # authenticated by libp2p: a peer can register only itself
            if peer not in self._expires and len(self.registered()) >= self.max_peers:
                answer = pb.RelayRegistered(
                    error=_error(
                        PeerUnavailableError(
                            f"this relay forwards to {self.max_peers} peers already; register with another relay"
                        )
                    )
                )
            else:
                self._expires[peer] = self.clock() + self.ttl_s
                answer = pb.RelayRegistered(ttl_s=self.ttl_s)
            await write_message(writer, answer)
        except (BadRequestError, ConnectionError, OSError) as exc:
            logger.debug("a registration from %s failed: %r", info.peer_id, exc)
        finally:
            writer.close()

    async def _relay(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        target = None
        try:
            request = await read_message(reader, pb.RelayOpen)
            try:
                target = PeerID.from_base58(request.peer_id)
            except Exception:
                raise BadRequestError(f"{request.peer_id!r} is not a peer id") from None
            if target not in self.registered():
                raise PeerUnavailableError(
                    f"peer {request.peer_id} is not registered with this relay (it left, or "
                    f"registered with another one)"
                )
            if (
                sum(self._streams.values()) >= self.max_streams
                or self._streams.get(target, 0) >= self.max_streams_per_peer
            ):
                raise PeerUnavailableError(
                    f"this relay carries all the streams it can to {request.peer_id}; try again later"
                )
            source = info.peer_id
            if self._sources.get(source, 0) >= self.max_streams_per_source:
                raise PeerUnavailableError(
                    f"this relay carries {self.max_streams_per_source} streams of yours already; close some first"
                )
            self._streams[target] = self._streams.get(target, 0) + 1
            self._sources[source] = self._sources.get(source, 0) + 1
            try:
                try:
                    _, peer_reader, peer_writer = await asyncio.wait_for(
                        self.p2p.call_binary_stream_handler(target, TUNNEL_PROTOCOL), OPEN_TIMEOUT_S
                    )
                except Exception as exc:  # its connection to us is gone: the daemon's ControlFailure, a timeout
                    raise PeerUnavailableError(f"peer {request.peer_id} did not take a stream: {exc!r}") from exc
                await write_message(writer, pb.RelayOpened())
                await splice((reader, writer), (peer_reader, peer_writer))
            finally:
                for counts, key in ((self._streams, target), (self._sources, source)):
                    counts[key] -= 1
                    if not counts[key]:
                        del counts[key]
        except SwarmError as exc:
            logger.debug("relaying for %s failed: %s", info.peer_id, exc)
            with contextlib.suppress(Exception):
                await write_message(writer, pb.RelayOpened(error=_error(exc)))
            writer.close()
        except (ConnectionError, OSError):
            writer.close()
        finally:
            self._tasks.discard(task)


async def register(p2p: hivemind.P2P, relay: PeerID, *, timeout_s: float = OPEN_TIMEOUT_S) -> float:
    """Register with `relay`; the registration's lifetime in seconds. A stream that ends before the relay's answer
    is opened once more, as a relayed tunnel's is (swarm/net/tunnel.py RELAY_TRIES): registering twice only renews.

    Raises:
        PeerUnavailableError: the relay could not be reached, or refused.
    """
    for tries in range(1, RELAY_TRIES + 1):
        try:
            return await _register_once(p2p, relay, timeout_s)
        except _StreamEnded as exc:
            if tries == RELAY_TRIES:
                raise PeerUnavailableError(f"relay {relay} did not answer the registration: {exc.__cause__}") from exc
            logger.debug("relay %s: the registration's stream ended before its answer; opening another", relay)
    raise AssertionError("unreachable")


class _StreamEnded(Exception):
    """A registration's stream ended before the relay's answer."""


async def _register_once(p2p: hivemind.P2P, relay: PeerID, timeout_s: float) -> float:
    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(relay, REGISTER_PROTOCOL), timeout_s)
    except Exception as exc:  # no route, no such protocol (not a relay), a timeout
        if "protocols not supported" in str(exc):
            raise PeerUnavailableError(
                f"{relay} does not relay (a bootstrap node started with --no-relay, or a peer without --relay)"
            ) from exc
        raise PeerUnavailableError(f"relay {relay} cannot be reached: {exc!r}") from exc
    try:
        await write_message(writer, pb.RelayRegistration())
        answer = await read_message(reader, pb.RelayRegistered, timeout_s=timeout_s)
    except (BadRequestError, ConnectionError, OSError) as exc:
        if isinstance(exc, (ConnectionError, OSError)) or isinstance(exc.__cause__, STREAM_ENDED):
            raise _StreamEnded() from exc
        raise PeerUnavailableError(f"relay {relay} did not answer the registration: {exc}") from exc
    finally:
        writer.close()
    if answer.HasField("error"):
        raise PeerUnavailableError(f"relay {relay} refused: {answer.error.message}")
    return answer.ttl_s


class RelayRegistrar:
    """Keeps a peer behind NAT registered with up to `wanted` relays among `candidates`, and among those that
    `discover` finds (peers that announce that they relay), when it has fewer."""

    def __init__(
        self,
        p2p: hivemind.P2P,
        candidates: Sequence[PeerID],
        *,
        wanted: int = 2,
        discover: Callable[[], Awaitable[Sequence[PeerID]]] | None = None,
    ):
        self.p2p, self.candidates, self.wanted, self.discover = p2p, list(candidates), wanted, discover
        self.relays: list[PeerID] = []
        self._renew_s = REGISTRATION_TTL_S / 3

    async def register(self) -> list[PeerID]:
        """Renew with the current relays, then fill up from the other candidates; the relays registered with."""
        current = await self._try(self.relays)  # clients know these from our record: keep them while they last
        if len(current) < self.wanted and self.discover is not None:
            try:
                found = await self.discover()
            except Exception as exc:  # the directory may be briefly unreachable
                logger.info("looking for relays in the directory failed: %r", exc)
                found = []
            self.candidates += [relay for relay in found if relay not in self.candidates and relay != self.p2p.peer_id]
        others = [relay for relay in self.candidates if relay not in current]
        if len(current) < self.wanted and others:
            current += (await self._try(others))[: self.wanted - len(current)]
        self.relays = current
        return current

    async def _try(self, relays: Sequence[PeerID]) -> list[PeerID]:
        results = await asyncio.gather(*(register(self.p2p, relay) for relay in relays), return_exceptions=True)
        accepted = []
        for relay, result in zip(relays, results):
            if isinstance(result, BaseException):
                logger.info("registering with relay %s failed: %s", relay, result)
            else:
                accepted.append(relay)
                self._renew_s = max(1.0, min(self._renew_s, result / 3))
        return accepted

    async def run_forever(self, on_change: Callable[[], None] = lambda: None) -> None:
        while True:
            await asyncio.sleep(self._renew_s)
            before = list(self.relays)
            try:
                await self.register()
            except Exception as exc:  # a bug of ours: keep trying next period
                logger.warning("renewing relay registrations failed: %r", exc)
            if self.relays != before:
                logger.warning("relays changed from %s to %s", [str(r) for r in before], [str(r) for r in self.relays])
                on_change()
