"""Speeds a client measured itself: routing counts a peer's announced throughput for at most CAP times that.

A record announces the peer's tokens/s; forward routes spread load by it and inference routes price compute by it,
so a peer that announces 1e7 would draw nearly all the traffic, whatever it really does. The client times each
forward call it makes (tokens over seconds, the network included: a lower bound of the peer's speed, which grows
with the request's size), and routes on

    min(announced, CAP x the best it measured of that peer)

A peer not measured yet counts for at most CAP times the best figure measured of any peer, so a newcomer's claim
is bounded by what the swarm has shown this client (and, while nothing is measured, it counts as announced). A
liar then draws at most about CAP times the share its real speed earns.

Inference steps are timed too: each span's answer, from the previous span's answer (or the send, for the first),
over the step's tokens. A client that only generates thus caps inference routes by what its own sessions saw; a
decode step of one token measures mostly the round trip, a prefill the peer's speed.
"""

from __future__ import annotations

from dataclasses import replace

from swarm.dht.snapshot import SwarmSnapshot

CAP = 4.0


class Speeds:
    """The best tokens/s this client measured of each peer."""

    def __init__(self):
        self.best: dict[str, float] = {}

    def record(self, peer_id: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.best[peer_id] = max(self.best.get(peer_id, 0.0), tokens / seconds)

    def forget(self, peer_id: str) -> None:
        self.best.pop(peer_id, None)

    def capped(self, snapshot: SwarmSnapshot) -> SwarmSnapshot:
        """`snapshot` with each announced throughput capped by what was measured (see the module docstring)."""
        if not self.best:
            return snapshot
        ceiling = CAP * max(self.best.values())
        servers = {}
        for peer_id, info in snapshot.servers.items():
            most = CAP * self.best[peer_id] if peer_id in self.best else ceiling
            servers[peer_id] = info if info.throughput <= most else info.model_copy(update={"throughput": most})
        return replace(snapshot, servers=servers)
