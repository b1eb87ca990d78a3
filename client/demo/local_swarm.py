"""A swarm of real processes on this machine (bootstrap + peers via the `swarmlm` CLI), for the demo and benchmarks.

Every child runs in its own process group and is stopped on exit (SIGTERM, then SIGKILL to the group),
also on Ctrl+C or an error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protocol.records import ServerState, prefix_for_model
from swarm.dht.directory import fetch_snapshot
from swarm.dht.node import start_dht
from swarm.trust.swarmkey import load_optional


def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous spans of nearly equal length covering [0, num_blocks)."""
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


class LocalSwarm:
    """Start with `start_bootstrap()` and `start_peer()`; `stop()` (or leaving the `with`) stops them all."""

    def __init__(self, log_dir: Path | None = None, *, python: str = sys.executable, swarm_key_file: str | None = None):
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="swarmlm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        # a private swarm: every child gets --swarm-key, and the watching DHT node the key
        self.swarm_key_file = swarm_key_file
        self._key_args = ("--swarm-key", swarm_key_file) if swarm_key_file else ()
        self.children: dict[str, subprocess.Popen] = {}
        self.initial_peers: list[str] = []
        self._dht = None

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.log(name), "w") as log:
            child = subprocess.Popen(
                [self.python, "-m", "swarm.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self._env(env),
            )
        self.children[name] = child
        return child

    @staticmethod
    def _env(extra: dict[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        # processes sharing this machine's cores: idle OpenMP threads should sleep, not spin
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return {**env, **(extra or {})}

    def start_bootstrap(self, timeout_s: float = 60.0) -> list[str]:
        child = self.start("bootstrap", "bootstrap", *self._key_args)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            maddrs = [
                line.strip() for line in self.log("bootstrap").read_text().splitlines() if line.startswith("/ip4/")
            ]
            if maddrs:
                self.initial_peers = maddrs
                return maddrs
            if child.poll() is not None:
                raise RuntimeError(f"the bootstrap node exited with {child.returncode}: {self.tail('bootstrap')}")
            time.sleep(0.1)
        raise TimeoutError(f"the bootstrap node printed no address within {timeout_s:.0f}s: {self.tail('bootstrap')}")

    def start_peer(self, name: str, model: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.start(name, "peer", model, "--initial-peers", *self.initial_peers, *self._key_args, *args, env=env)

    def wait_online(
        self,
        model: str,
        num_blocks: int,
        spans: list[tuple[int, int]] | None = None,
        *,
        dht_prefix: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        """Wait until every block (or every span in `spans`) is served by an ONLINE peer."""
        prefix = dht_prefix or prefix_for_model(model)
        if self._dht is None:
            self._dht = start_dht(self.initial_peers, client_mode=True, swarm_key=load_optional(self.swarm_key_file))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snapshot = fetch_snapshot(self._dht, prefix, num_blocks)
            online = {(i.start_block, i.end_block) for i in snapshot.servers.values() if i.state == ServerState.ONLINE}
            if (spans is None and not snapshot.uncovered_blocks()) or (spans is not None and set(spans) <= online):
                return
            for name, child in self.children.items():
                if child.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {child.returncode}: {self.tail(name)}")
            time.sleep(0.3)
        raise TimeoutError(f"peers of {prefix} not ONLINE within {timeout_s:.0f}s; logs in {self.log_dir}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a child's whole process group (SIGKILL: the machine died)."""
        _signal_group(self.children[name], sig)

    def stop_child(self, name: str, timeout_s: float = 10.0) -> None:
        """Stop one child cleanly (SIGTERM, then SIGKILL to its group) and forget it."""
        child = self.children.pop(name)
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child, signal.SIGKILL)
        child.wait()

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join(self.log(name).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None
        for child in reversed(list(self.children.values())):  # peers first: the bootstrap node relays their OFFLINE
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)  # the process itself, which then stops its DHT process
        deadline = time.monotonic() + timeout_s
        for child in self.children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child, signal.SIGKILL)  # also whatever the child left in its group
            child.wait()


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
