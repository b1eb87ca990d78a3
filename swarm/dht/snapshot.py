"""A point-in-time view of who serves which blocks of one model: the input of every placement and routing decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.records import CLOCK_SKEW_S, MAX_JOINING_S, ServerInfo, ServerState


@dataclass(frozen=True)
class SwarmSnapshot:
    """The servers of one model, by peer id, as last read from the DHT."""

    num_blocks: int
    servers: dict[str, ServerInfo] = field(default_factory=dict)
    expirations: dict[str, float] = field(default_factory=dict)
    """Peer id -> expiration (DHT time) of its latest record: a later one means the peer announced again."""
    public_keys: dict[str, bytes] = field(default_factory=dict)
    """Peer id -> the RSA public key (OpenSSH format) its records are signed with; the peer id is that key's."""
    taken_at: float | None = None
    """DHT time of the read; None (a snapshot built by hand) leaves JOINING records unbounded in time."""

    def live(self) -> dict[str, ServerInfo]:
        """Servers that are ONLINE, or JOINING since less than MAX_JOINING_S (OFFLINE ones are leaving)."""
        return {
            pid: info
            for pid, info in self.servers.items()
            if info.state == ServerState.ONLINE or (info.state == ServerState.JOINING and self.joining(info))
        }

    def joining(self, info: ServerInfo) -> bool:
        """Whether a JOINING record still counts: it began joining at most MAX_JOINING_S before the read (and not
        in the future, beyond clock skew). A peer cannot stretch this by announcing again: joined_at is in the
        record it signs, and honest peers keep it for as long as they load the span."""
        if self.taken_at is None:
            return True
        return self.taken_at - MAX_JOINING_S <= info.joined_at <= self.taken_at + CLOCK_SKEW_S

    def verify(self, peer_id: str, data: bytes, signature: bytes) -> bool:
        """Whether `signature` over `data` is by the key `peer_id` announced with (False for an unknown peer)."""
        from swarm.trust.identity import verify_signature  # hivemind's crypto: not for every reader of a snapshot

        public_key = self.public_keys.get(peer_id)
        return public_key is not None and verify_signature(public_key, data, signature)

    def online(self) -> dict[str, ServerInfo]:
        return {pid: info for pid, info in self.servers.items() if info.state == ServerState.ONLINE}

    def servers_of_block(self, block: int, *, online_only: bool = True) -> dict[str, ServerInfo]:
        pool = self.online() if online_only else self.live()
        return {pid: info for pid, info in pool.items() if info.start_block <= block < info.end_block}

    def uncovered_blocks(self, *, online_only: bool = True) -> list[int]:
        return [b for b in range(self.num_blocks) if not self.servers_of_block(b, online_only=online_only)]
