"""What a peer's placement decisions count (swarm/placement.py): records it has verified, JOINING ones for a while.

A record is a claim, and two kinds of claim would steer honest peers: a high throughput announced for blocks that
nobody serves there (a dead or made-up peer: honest peers leave those blocks to it), and a JOINING record renewed
with a fresh `joined_at` (its blocks look covered for ever). So a peer decides on a view of the snapshot where
- another peer's record counts once the server at its endpoint signed a fresh nonce with the key the record is
  signed with (swarm/trust/identity.py), checked again after VERIFIED_S; a peer reached only through libp2p
  (`transport` "p2p") is asked through a tunnel of this peer's DHT node;
- a JOINING record counts as begun when this peer first saw that peer on that span, if its `joined_at` is later:
  it stops counting MAX_JOINING_S after that, however often it is announced again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable

from hivemind.utils import get_dht_time

from protocol.records import ServerInfo
from protocol.vocab import Transport
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import tunnel_address
from swarm.trust.identity import identity_challenge

logger = logging.getLogger(__name__)

VERIFIED_S = 300.0  # a record verified counts this long before its endpoint is asked again
PING_TIMEOUT_S = 5.0
MAX_RELAYS_ASKED = 2  # a record may name many relays: asking each would let one record cost many dials

Ping = Callable[[str, bytes, float], Awaitable[bytes]]
"""(endpoint, nonce, timeout_s) -> the identity proof the server there answers; raises when it does not answer."""


class PlacementView:
    """Successive snapshots, filtered for placement (module docstring); one per peer, kept across its decisions."""

    def __init__(self, own_peer_id: str, ping: Ping, clock: Callable[[], float] = get_dht_time):
        self.own_peer_id, self._ping, self._clock = own_peer_id, ping, clock
        self._first_seen: dict[tuple[str, int, int], float] = {}
        self._verified_until: dict[tuple[str, str], float] = {}  # (peer id, endpoint) -> clock time

    async def trusted(self, snapshot: SwarmSnapshot) -> SwarmSnapshot:
        """`snapshot` with only the records that count, JOINING ones dated no later than first seen."""
        now = self._clock()
        self._first_seen = {
            (pid, info.start_block, info.end_block): self._first_seen.get((pid, info.start_block, info.end_block), now)
            for pid, info in snapshot.servers.items()
        }  # a peer gone from the snapshot is forgotten: seen again, it is new again
        self._verified_until = {key: until for key, until in self._verified_until.items() if until > now}
        unchecked = [
            (pid, info)
            for pid, info in snapshot.live().items()
            if self._needs_check(pid, info) and (pid, info.endpoint) not in self._verified_until
        ]
        results = await asyncio.gather(*(self._check(pid, info, snapshot) for pid, info in unchecked))
        for (pid, info), verified in zip(unchecked, results):
            if verified:
                self._verified_until[(pid, info.endpoint)] = now + VERIFIED_S
        servers = {
            pid: self._dated(pid, info)
            for pid, info in snapshot.servers.items()
            if not self._needs_check(pid, info) or (pid, info.endpoint) in self._verified_until
        }
        dropped = sorted(set(snapshot.live()) - set(servers))
        if dropped:
            logger.info(
                "placement leaves out %d record(s) whose endpoint did not prove them: %s", len(dropped), dropped
            )
        return dataclasses.replace(snapshot, servers=servers)

    def _needs_check(self, peer_id: str, info: ServerInfo) -> bool:
        return peer_id != self.own_peer_id

    def _dated(self, peer_id: str, info: ServerInfo) -> ServerInfo:
        first = self._first_seen[(peer_id, info.start_block, info.end_block)]
        return info.model_copy(update={"joined_at": first}) if info.joined_at > first else info

    async def _check(self, peer_id: str, info: ServerInfo, snapshot: SwarmSnapshot) -> bool:
        for address in _addresses(peer_id, info):
            nonce = os.urandom(16)
            try:
                proof = await self._ping(address, nonce, PING_TIMEOUT_S)
            except Exception as exc:  # not there, or not answering: nothing to count
                logger.debug("peer %s does not answer at %s: %r", peer_id, address, exc)
                continue
            if snapshot.verify(peer_id, identity_challenge(nonce, peer_id), proof):
                return True
        return False


def _addresses(peer_id: str, info: ServerInfo) -> list[str]:
    """Where a record's server is asked: its gRPC endpoint, or, for a peer reached only through libp2p, the peer
    through each of its relays (at most MAX_RELAYS_ASKED; straight to it when it names none)."""
    if info.transport != Transport.P2P:
        return [info.endpoint]
    relays = list(info.relays)[:MAX_RELAYS_ASKED]
    return [tunnel_address(peer_id, relay) for relay in relays] or [tunnel_address(peer_id)]
