"""The monitor's view of the swarm: DHT records read every `refresh_s`, each ONLINE peer pinged, one document kept.

A ping is an Info call carrying a random nonce, tried on the peer's addresses in the order a client dials them
(client/routing.py); it counts only if the answer signs the nonce with the key the record's owner announced with,
so a record pointing at someone else's server shows as "wrong key", and a crashed peer as "no answer" long before
its record expires. Records come through swarm/dht/directory.py, which skips whatever does not validate.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import hivemind

from client.monitor.config import MonitorConfig
from client.routing import dial_candidates
from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import ServerInfo
from swarm.dht.snapshot import SwarmSnapshot
from swarm.dht.state import ANSWERED, NO_ANSWER, WRONG_KEY, Ping, build_state, read_state
from swarm.net.tunnel import TunnelPool
from swarm.training.recipe import recipes_of_runs, recipes_on_wire
from swarm.trust.identity import identity_challenge
from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

_MAX_INFO_BYTES = 1 << 20  # an Info answer is a few hundred bytes


class Watcher:
    """Keeps `state`, the latest document, fresh. Lives on the HTTP server's event loop (`run` until cancelled)."""

    def __init__(self, dht: hivemind.DHT, config: MonitorConfig, swarm_key: SwarmKey | None = None):
        self.dht, self.config = dht, config
        self._p2p: hivemind.P2P | None = None
        self.pool = ChannelPool(_MAX_INFO_BYTES, TunnelPool(self._get_p2p), swarm_key=swarm_key)
        self.state: dict[str, Any] | None = None
        """The latest document (swarm/dht/state.py) and "error": why the latest refresh failed, else null."""
        self.refreshes = 0

    async def _get_p2p(self) -> hivemind.P2P:
        if self._p2p is None:
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    async def run(self) -> None:
        """Refresh every `refresh_s` (counted from the start of the previous refresh) until cancelled."""
        while True:
            began = time.monotonic()
            await self.refresh()
            await asyncio.sleep(max(0.0, self.config.refresh_s - (time.monotonic() - began)))

    async def refresh(self) -> None:
        """Read the swarm and ping its peers once; on failure keep the last document and say why in "error"."""
        try:
            models, snapshots = await asyncio.to_thread(read_state, self.dht)
            recipes = await asyncio.to_thread(recipes_of_runs, self.dht, snapshots)
            pings = await self.ping_all(snapshots)
            state = build_state(models, snapshots, pings=pings, recipes=recipes_on_wire(recipes))
        except Exception as exc:  # whatever went wrong, the page must say so and the next refresh try again
            logger.warning("reading the swarm failed: %s", exc, exc_info=not isinstance(exc, SwarmError))
            state = dict(self.state or build_state({}, {}, pings={}))
            state["error"] = str(exc) if isinstance(exc, SwarmError) else f"{type(exc).__name__}: {exc}"
        self.state = state
        self.refreshes += 1

    async def ping_all(self, snapshots: dict[str, SwarmSnapshot]) -> dict[str, Ping]:
        """Ping every ONLINE peer of every model once (a peer id found in several models is pinged once)."""
        targets: dict[str, tuple[ServerInfo, SwarmSnapshot]] = {}
        for snapshot in snapshots.values():
            for peer_id, info in snapshot.online().items():
                targets.setdefault(peer_id, (info, snapshot))
        results = await asyncio.gather(
            *(self.ping(peer_id, info, snapshot) for peer_id, (info, snapshot) in targets.items())
        )
        return dict(zip(targets, results))

    async def ping(self, peer_id: str, info: ServerInfo, snapshot: SwarmSnapshot) -> Ping:
        """The first of the peer's addresses whose answer proves its key gives the RTT."""
        outcome = NO_ANSWER
        for address in dial_candidates(peer_id, info):
            nonce = os.urandom(16)
            began = time.perf_counter()
            try:
                answer = await self.pool.unary(address, "info", pb.InfoRequest(nonce=nonce), self.config.ping_timeout_s)
            except SwarmError as exc:
                logger.debug("peer %s does not answer at %s: %s", peer_id, address, exc)
                await self.pool.drop(address)
                continue
            rtt_s = time.perf_counter() - began
            if snapshot.verify(peer_id, identity_challenge(nonce, peer_id), answer.identity_proof):
                return Ping(ANSWERED, rtt_s)
            outcome = WRONG_KEY
            await self.pool.drop(address)
        return Ping(outcome)

    async def close(self) -> None:
        await self.pool.close()
        if self._p2p is not None:  # its tasks live on this loop: end them before the loop does
            await self._p2p.shutdown()
