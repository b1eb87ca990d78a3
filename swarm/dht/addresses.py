"""Multiaddrs a node announces, checked before anything heavy is imported (flags are answered at once)."""

from __future__ import annotations

import ipaddress
import re


def announce_maddr(host: str, port: int) -> str:
    """The multiaddr announced for `host` (an IPv4 or IPv6 address, or a DNS name) and a fixed `port`.

    Raises:
        ValueError: port 0 (others cannot dial a port chosen at random), or a host with spaces or slashes.
    """
    if not 0 < port <= 65535:
        raise ValueError(f"announcing {host} needs a fixed port (--port / --dht-port), got {port}")
    try:
        kind = "ip6" if ipaddress.ip_address(host).version == 6 else "ip4"
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", host):
            raise ValueError(f"an announced host must be an IP address or a DNS name, got {host!r}") from None
        kind = "dns"
    return f"/{kind}/{host}/tcp/{port}"
