"""Starting hivemind DHT nodes the way every swarmlm role needs them: loopback by default, nothing contacted unasked,
records signed by the node's key and checked against our schemas (swarm/trust/identity.py, swarm/dht/validators.py)."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from protocol.errors import DHTUnavailableError, UnauthorizedError
from swarm.dht.addresses import announce_maddr
from swarm.dht.validators import SwarmRecordValidator
from swarm.trust.identity import NodeIdentity, fresh_identity, load_identity
from swarm.trust.swarmkey import SwarmKey, refused_message

logger = logging.getLogger(__name__)


def start_dht(
    initial_peers: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    identity: NodeIdentity | None = None,
    client_mode: bool = False,
    startup_timeout_s: float = 60.0,
    swarm_key: SwarmKey | None = None,
    announce_host: str | None = None,
) -> hivemind.DHT:
    """Start a DHT node in its own process and wait until it is connected.

    Its libp2p key also signs its records: the returned node's `identity` gives the subkey under which it
    announces (NodeIdentity.record_subkey).

    Args:
        initial_peers: multiaddrs of peers already in the swarm (empty for the first node).
        host: address to listen on; 127.0.0.1 unless exposing the node is asked for.
        port: TCP port, 0 for an ephemeral one.
        identity_path: key file for a stable peer id (created if missing); hivemind checks that no node of the
            swarm uses it already.
        identity: a key this process holds already (swarm.trust.identity.claim_identity); by default a fresh one.
        client_mode: a client node only makes requests and does not serve the DHT.
        swarm_key: the key of a private swarm (swarm/trust/dhtauth.py); None for a public one.
        announce_host: the address (IP or DNS name) others reach the node at, announced instead of the interfaces it
            listens on (a public host behind 1:1 NAT, or one listening on 0.0.0.0); needs a fixed `port`.
    """
    kwargs = {}
    if swarm_key is not None:
        from swarm.trust.dhtauth import SwarmKeyAuthorizer

        kwargs["authorizer"] = SwarmKeyAuthorizer(swarm_key)
    if not client_mode:
        kwargs["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
        if announce_host is not None:
            kwargs["announce_maddrs"] = [announce_maddr(announce_host, port)]
    if identity_path is not None:
        identity = load_identity(identity_path)
    else:
        identity = identity or fresh_identity()
        kwargs["check_if_identity_free"] = False  # it is new, or locked by this process
    kwargs["identity_path"] = str(identity.path)
    try:
        dht = _start_node(initial_peers, client_mode, startup_timeout_s, identity, kwargs)
    except BaseException as exc:
        if "none of the initial_peers responded" in str(exc):  # connected, yet no DHT answer passed the authorizer
            raise UnauthorizedError(refused_message(swarm_key, initial_peers)) from exc
        raise
    finally:
        identity.started()
    if dht.peer_id.to_base58() != identity.peer_id:  # records would be signed by a key that is not the node's
        stop_dht(dht)
        raise RuntimeError(f"the DHT node runs as {dht.peer_id} but its key gives {identity.peer_id}")
    return dht


def _start_node(initial_peers, client_mode: bool, startup_timeout_s: float, identity: NodeIdentity, kwargs):
    def make() -> hivemind.DHT:
        dht = _OwnGroupDHT(
            initial_peers=list(initial_peers),
            # no NAT probing or UPnP mapping: a node contacts only the peers it is given
            auto_nat=False,
            nat_port_map=False,
            client_mode=client_mode,
            start=False,
            startup_timeout=startup_timeout_s,
            # the signature check first (higher priority), then ours on the value it leaves (swarm/dht/validators.py)
            record_validators=[identity.validator(), SwarmRecordValidator()],
            **kwargs,
        )
        dht.identity = identity
        return dht

    return _start_forked(make, startup_timeout_s + 5)


def start_plain_dht(
    initial_peers: Sequence[str] = (),
    record_validators=(),
    *,
    client_mode: bool = False,
    ensure_bootstrap_success: bool = True,
) -> hivemind.DHT:
    """A hivemind DHT node as hivemind starts one (none of our validators), on 127.0.0.1: for bare hivemind averagers,
    whose matchmaking records our nodes refuse, and for tests that play a stranger (one that goes on although nobody
    answered its pings: `ensure_bootstrap_success=False`)."""

    def make() -> hivemind.DHT:
        return hivemind.DHT(
            initial_peers=list(initial_peers),
            start=False,
            client_mode=client_mode,
            auto_nat=False,
            nat_port_map=False,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=list(record_validators),
            ensure_bootstrap_success=ensure_bootstrap_success,
        )

    return _start_forked(make, 65)


def _start_forked(make, timeout_s: float) -> hivemind.DHT:
    """Fork the node `make()` gives and wait until it is ready; once more if it never said anything.

    A forked child that stays silent past the timeout (it did not even fail) is killed and forked again: the test
    suite saw this about once in a few thousand starts on a busy machine (its cause is not traced yet).
    """
    for attempt in (1, 2):
        dht = make()
        _fork(dht)
        try:
            dht.wait_until_ready(timeout=timeout_s)
            return dht
        except concurrent.futures.TimeoutError:
            stop_dht(dht)
            if attempt == 2:
                raise DHTUnavailableError(
                    f"the DHT process did not start within {timeout_s:g}s, twice; if this repeats, "
                    f"check that this machine can start processes and reach --initial-peers"
                ) from None
            logger.warning("the DHT process said nothing within %gs; starting it again", timeout_s)
        except BaseException:
            stop_dht(dht)
            raise
    raise AssertionError("unreachable")


def _fork(dht: hivemind.DHT) -> None:
    # hivemind forks the node's process. Objects the child inherits from other threads (gRPC channels
    # closed in this process, say) must not be finalized there: that crashes it. So collect here and
    # freeze what is left, which keeps the child's garbage collector away from it.
    gc.collect()
    gc.freeze()
    try:
        dht.run_in_background(await_ready=False)
    finally:
        gc.unfreeze()


class _OwnGroupDHT(hivemind.DHT):
    """hivemind's DHT process, in a process group of its own, that stops once the process that started it is gone.

    A signal to the starter's process group (Ctrl+C in a terminal, `kill -TERM -PGID`) then reaches the starter
    alone, and the DHT is still there for what the starter does on its way out: a peer announces OFFLINE through
    it, then stops it. In exchange the DHT no longer dies with that group, so it watches its parent instead and
    takes itself and its p2pd down when the parent dies without stopping it (SIGKILL, a crash).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._starter_pid = os.getpid()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not whatever Python handler the starter had installed
        try:
            os.setpgid(0, 0)  # before hivemind starts p2pd, so that p2pd joins this group too
        except OSError as exc:  # then it stays in the starter's group and goes down with it, as before
            logger.warning("the DHT process stays in its starter's process group: %r", exc)
        else:
            threading.Thread(
                target=_exit_with_starter, args=(self._starter_pid,), name="exit-with-starter", daemon=True
            ).start()
        super().run()


def _exit_with_starter(starter_pid: int, poll_s: float = 0.5) -> None:
    """Runs in the DHT process: once its parent is no longer the starter (it died), stop this process group."""
    while os.getppid() == starter_pid:
        time.sleep(poll_s)
    os.killpg(0, signal.SIGTERM)


DHT_CALL_TIMEOUT_S = 30.0  # a DHT lookup or store on a healthy node takes well under a second to a few seconds


def dht_result(dht: hivemind.DHT, future, what: str, timeout_s: float = DHT_CALL_TIMEOUT_S):
    """The result of `future`, a call running in `dht`'s process; DHTUnavailableError after `timeout_s` or once
    that process is gone.

    hivemind's own calls wait forever, and a node whose process died (or was stopped under the call) never
    answers: the waiting thread would then also keep the interpreter from exiting.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.result(timeout=0.2)
        except concurrent.futures.TimeoutError:
            if not dht.is_alive():
                raise DHTUnavailableError(f"{what}: this process's DHT node has stopped") from None
            if time.monotonic() > deadline:
                raise DHTUnavailableError(
                    f"{what}: this process's DHT node did not answer within {timeout_s:g}s; "
                    f"if this repeats, restart the process"
                ) from None


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


def peer_ids_of(maddrs: Sequence[str]) -> list[PeerID]:
    """The peer ids in multiaddrs ("/ip4/.../tcp/.../p2p/<id>"), each once, in order; others are skipped."""
    found = []
    for maddr in maddrs:
        try:
            peer = PeerID.from_base58(Multiaddr(maddr)["p2p"])
        except Exception:  # no /p2p/ part, or not a multiaddr: hivemind rejects those when it joins
            continue
        if peer not in found:
            found.append(peer)
    return found
