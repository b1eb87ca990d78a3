"""Where a client reaches each peer, and how far away it is: found by pinging the addresses of its record.

Peers are reached only at the addresses of their records, which `fetch_snapshot` validated. Each peer is reached
by the first of its addresses that answers a ping (`routing.dial_candidates`): its gRPC endpoint, or libp2p
streams, straight or through its relays; the ping's time is the RTT that inference routing counts. The answer
must prove the key of the record's owner (swarm/trust/identity.py), or the peer is banned as an impostor. A peer
that answers on none of its addresses is not routed to for `UNREACHABLE_S` (a stopped process whose record lives
on, announcing any throughput, would otherwise make each request that goes to it wait out its timeout), then it is
pinged again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from client.bans import BanList
from client.routing import RouteHop, dial_candidates
from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import ServerInfo
from swarm.dht.snapshot import SwarmSnapshot
from swarm.trust.identity import identity_challenge

logger = logging.getLogger(__name__)

UNREACHABLE_S = 30.0
"""How long a peer whose ping no address answered is left out of routes before it is pinged again."""


class Dialer:
    """Each peer's path (the address its ping answered on) and round trip, measured once per announced address set.

    Coroutines run on the client's loop.
    """

    def __init__(self, pool: ChannelPool, bans: BanList, clock: Callable[[], float] = time.monotonic):
        self.pool, self.bans, self.clock = pool, bans, clock
        self.rtts: dict[str, float] = {}  # peer id -> measured round-trip time in seconds
        self.paths: dict[str, str] = {}  # peer id -> the address its ping answered on
        # peer id -> the addresses its record announced when it was measured: a peer that comes back under the
        # same id (its key is kept) at another endpoint is measured afresh, not dialed at its old address
        self._measured_at: dict[str, tuple[str, ...]] = {}
        self._unreachable: dict[str, float] = {}  # peer id -> when none of its addresses answered a ping

    def unreachable(self) -> set[str]:
        """Peers whose latest ping none of their addresses answered, within the last UNREACHABLE_S."""
        now = self.clock()
        return {pid for pid, at in self._unreachable.items() if now - at < UNREACHABLE_S}

    async def measure_rtts(
        self, snapshot: SwarmSnapshot, timeout_s: float = 1.0, only: Collection[str] | None = None
    ) -> None:
        """Ping (an Info call) every ONLINE peer not measured yet (or those of `only`) on each of its addresses in
        turn; the first that answers is its path. One that does not answer gets `timeout_s`."""
        unknown = [
            (pid, info)
            for pid, info in snapshot.online().items()
            if (only is None or pid in only) and not self._measured(pid, info)
        ]
        await asyncio.gather(*(self._find_path(pid, info, timeout_s, snapshot) for pid, info in unknown))

    async def _find_path(self, peer_id: str, info: ServerInfo, timeout_s: float, snapshot: SwarmSnapshot | None) -> str:
        """The first of the peer's addresses where the answer to a ping proves the peer's key (swarm/trust/identity.py).

        A server at an announced endpoint that cannot sign the nonce with the key of the record's owner is not
        that peer: the record points at someone else's server. Such a peer is banned (its record is a lie).
        """
        candidates = dial_candidates(peer_id, info)
        self._measured_at[peer_id] = tuple(candidates)
        self.paths.pop(peer_id, None)
        impostors = []
        for address in candidates:
            nonce = os.urandom(16)
            began = time.perf_counter()
            try:
                answer = await self.pool.unary(address, "info", pb.InfoRequest(nonce=nonce), timeout_s)
            except SwarmError as exc:
                logger.debug("peer %s does not answer at %s: %s", peer_id, address, exc)
                await self.pool.drop(address)
                continue
            rtt = time.perf_counter() - began
            if snapshot is None or not snapshot.verify(
                peer_id, identity_challenge(nonce, peer_id), answer.identity_proof
            ):
                impostors.append(address)
                await self.pool.drop(address)
                continue
            self.rtts[peer_id], self.paths[peer_id] = rtt, address
            self._unreachable.pop(peer_id, None)
            if address != candidates[0]:
                logger.info("peer %s is reached at %s (not at %s)", peer_id, address, candidates[0])
            return address
        self.rtts[peer_id] = timeout_s
        self._unreachable[peer_id] = self.clock()
        if impostors:
            length_s = self.bans.ban(peer_id)
            logger.warning(
                "the server at %s does not hold the key of peer %s, whose record announces it: banned for %.0fs",
                ", ".join(impostors),
                peer_id,
                length_s,
            )
        return candidates[0]

    def _measured(self, peer_id: str, info: ServerInfo) -> bool:
        """Whether `peer_id` was measured at the addresses `info` announces (and, if it answered none, lately)."""
        if peer_id in self._unreachable and peer_id not in self.unreachable():
            return False  # time to ping it again
        return peer_id in self.rtts and self._measured_at.get(peer_id) == tuple(dial_candidates(peer_id, info))

    async def address_of(
        self, peer_id: str, info: ServerInfo, snapshot: SwarmSnapshot | None, timeout_s: float = 1.0
    ) -> str:
        """Where to send `peer_id`'s requests: the path its ping answered on, found now if it is not known.

        `snapshot` holds the keys that the ping's answer is checked against (None: no answer is trusted).
        """
        if peer_id not in self.paths or not self._measured(peer_id, info):
            return await self._find_path(peer_id, info, timeout_s, snapshot)
        return self.paths[peer_id]

    def on_paths(self, hops: Sequence[RouteHop]) -> list[RouteHop]:
        """`hops` sent where their peers answered (a peer never measured keeps its announced endpoint)."""
        return [replace(hop, endpoint=self.paths.get(hop.peer_id, hop.endpoint)) for hop in hops]

    def forget(self, peer_id: str) -> None:
        """Measure `peer_id` (and find its path) afresh if it comes back: it failed or lied."""
        self.rtts.pop(peer_id, None)
        self.paths.pop(peer_id, None)
        self._unreachable.pop(peer_id, None)
