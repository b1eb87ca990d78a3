"""Starting hivemind DHT nodes the way every swarmlm role needs them: loopback by default, nothing contacted unasked."""

from __future__ import annotations

import gc
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
    dht = hivemind.DHT(
        initial_peers=list(initial_peers),
        # no NAT probing or UPnP mapping: a node contacts only the peers it is given
        auto_nat=False,
        nat_port_map=False,
        client_mode=client_mode,
        start=False,
        startup_timeout=startup_timeout_s,
        **kwargs,
    )
    # hivemind forks the node's process. Objects the child inherits from other threads (gRPC channels
    # closed in this process, say) must not be finalized there: that crashes it. So collect here and
    # freeze what is left, which keeps the child's garbage collector away from it.
    gc.collect()
    gc.freeze()
    try:
        dht.run_in_background(await_ready=False)
    finally:
        gc.unfreeze()
    try:
        dht.wait_until_ready(timeout=startup_timeout_s + 5)
    except BaseException:
        stop_dht(dht)
        raise
    return dht


def stop_dht(dht: hivemind.DHT, timeout_s: float = 5.0) -> None:
    """Shut a DHT node down, killing its process if it does not stop within `timeout_s`."""
    if dht.is_alive():
        try:
            dht.shutdown()
        except Exception as exc:  # a node whose process already died cannot be asked to stop
            logger.debug("DHT shutdown failed: %r", exc)
        dht.join(timeout_s)
    if dht.is_alive():
        logger.warning("the DHT process did not stop within %.0fs; killing it", timeout_s)
        dht.kill()
        dht.join(timeout_s)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(maddr) for maddr in dht.get_visible_maddrs()]
