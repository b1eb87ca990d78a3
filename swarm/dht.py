"""Starting hivemind DHT nodes the way every swarmlm role needs them: loopback by default, nothing contacted unasked."""

from __future__ import annotations

import logging
from typing import Sequence

import hivemind

logger = logging.getLogger(__name__)


def start_dht(
    initial_peers: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    client_mode: bool = False,
    startup_timeout_s: float = 60.0,
) -> hivemind.DHT:
    """Start a DHT node in its own process and wait until it is connected.

    Args:
        initial_peers: multiaddrs of peers already in the swarm (empty for the first node).
        host: address to listen on; 127.0.0.1 unless exposing the node is asked for.
        port: TCP port, 0 for an ephemeral one.
        identity_path: key file for a stable peer id (created if missing).
        client_mode: a client node only makes requests and does not serve the DHT.
    """
    kwargs = {}
    if not client_mode:
        kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
    if identity_path is not None:
        kwargs["identity_path"] = identity_path
    return hivemind.DHT(
        initial_peers=list(initial_peers),
        # no NAT probing or UPnP mapping: a node contacts only the peers it is given
        auto_nat=False,
        nat_port_map=False,
        client_mode=client_mode,
        start=True,
        await_ready=True,
        startup_timeout=startup_timeout_s,
        **kwargs,
    )


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]
