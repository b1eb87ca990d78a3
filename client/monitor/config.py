"""MonitorConfig: the settings of `swarmlm monitor`."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    host: str = "127.0.0.1"
    """Address the HTTP server listens on; loopback unless exposing the page is asked for."""
    port: int = 8080
    """TCP port of the HTTP server; 0 for an ephemeral one (the command prints the page's address)."""
    refresh_s: float = 5.0
    """Seconds between two reads of the swarm (DHT records and pings); the page polls as often."""
    ping_timeout_s: float = 2.0
    """How long one ping (an Info call to one of a peer's addresses) may take before it counts as no answer."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        for name in ("refresh_s", "ping_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0.1 <= value <= 3600):
                raise ValueError(f"{name} must be between 0.1 and 3600 seconds, got {value}")
