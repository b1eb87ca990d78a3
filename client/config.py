"""Configuration of a distributed model client."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """How a client finds peers and talks to them."""

    initial_peers: tuple[str, ...]
    """Multiaddrs to join the DHT through (e.g. the bootstrap node's)."""
    dht_prefix: str | None = None
    """Name of the model in the DHT; derived from the model name when None."""
    request_timeout_s: float = 60.0
    """Longest wait for one peer's answer before it counts as failed."""
    connect_timeout_s: float = 10.0
    """Longest wait to open a session on a peer (cache allocation included)."""
    max_retries: int = 4
    """Route changes tried per request after peer failures, before giving up."""
    retry_delay_s: float = 0.5
    """First back-off after a failure; doubles with each retry."""
    directory_refresh_s: float = 5.0
    """A cached view of who serves what is refreshed after this long (and at once after a failure)."""
    wait_for_peers_s: float = 20.0
    """How long to wait for some blocks to be served before raising NoPeersError."""
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest gRPC message sent or accepted."""

    def __post_init__(self) -> None:
        if not self.initial_peers:
            raise ValueError("initial_peers is empty; pass the bootstrap node's multiaddr, e.g. /ip4/.../tcp/.../p2p/...")
        for name in ("request_timeout_s", "connect_timeout_s", "directory_refresh_s", "max_message_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_retries", "retry_delay_s", "wait_for_peers_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
