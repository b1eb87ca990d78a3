"""A point-in-time view of who serves which blocks of one model: the input of every placement and routing decision."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.records import ServerInfo, ServerState


@dataclass(frozen=True)
class SwarmSnapshot:
    """The servers of one model, by peer id, as last read from the DHT."""

    num_blocks: int
    servers: dict[str, ServerInfo] = field(default_factory=dict)
    expirations: dict[str, float] = field(default_factory=dict)
    """Peer id -> expiration (DHT time) of its latest record: a later one means the peer announced again."""

    def live(self) -> dict[str, ServerInfo]:
        """Servers that are JOINING or ONLINE (OFFLINE ones are leaving)."""
        return {pid: info for pid, info in self.servers.items() if info.state != ServerState.OFFLINE}

    def online(self) -> dict[str, ServerInfo]:
        return {pid: info for pid, info in self.servers.items() if info.state == ServerState.ONLINE}

    def servers_of_block(self, block: int, *, online_only: bool = True) -> dict[str, ServerInfo]:
        pool = self.online() if online_only else self.live()
        return {pid: info for pid, info in pool.items() if info.start_block <= block < info.end_block}

    def uncovered_blocks(self, *, online_only: bool = True) -> list[int]:
        return [b for b in range(self.num_blocks) if not self.servers_of_block(b, online_only=online_only)]
