"""The peers of a soak run: slots of overlapping spans, each served by one real `swarmlm peer` at a time.

A slot's process (an incarnation) is killed now and then (SIGKILL to its process group: the machine died; or
SIGTERM to the peer: a clean leave) and replaced at once by a fresh one on a fresh port. A victim is chosen only
among slots whose blocks other ONLINE peers also serve, so the swarm always covers every block: a client error
is then a loss, not bad luck. An incarnation that exits unasked is a crash, recorded with its log, and replaced.

`poll()` (called every second by the soak's sampler) notes which incarnations are ONLINE (their log says so),
finds crashes and records any moment when some block had no ONLINE peer; `sample_rss()` reads each ONLINE
incarnation's resident memory (the peer process itself: the KV caches and tensors live there).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import psutil

from client.demo.local_swarm import LocalSwarm

ONLINE_LINE = "ONLINE: serving blocks"


def overlapping_spans(num_blocks: int, peers: int) -> list[tuple[int, int]]:
    """`peers` spans where every block has at least two peers and spans overlap at different boundaries.

    The first two halve the model; the others cycle through [0, 3/4), [1/4, 1), [0, 1/2), [1/2, 1) of it (three
    peers: the halves and the whole model).
    """
    if peers < 3 or num_blocks < 2:
        raise ValueError(f"a churning swarm needs >= 3 peers and >= 2 blocks, got {peers} peers, {num_blocks} blocks")
    half, quarter, three_quarters = num_blocks // 2, max(1, num_blocks // 4), max(1, (3 * num_blocks + 3) // 4)
    spans = [(0, half), (half, num_blocks)]
    if peers == 3:
        return [*spans, (0, num_blocks)]
    extra = [(0, three_quarters), (quarter, num_blocks), (0, half), (half, num_blocks)]
    spans += [extra[i % len(extra)] for i in range(peers - 2)]
    for block in range(num_blocks):
        assert sum(a <= block < b for a, b in spans) >= 2, (block, spans)
    return spans


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Incarnation:
    """One process of a slot, from its start to its end."""

    name: str
    span: tuple[int, int]
    port: int
    pid: int
    started: float
    online_at: float | None = None
    ended: str | None = None  # "SIGKILL", "SIGTERM" or "crash (exit N)"
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (monotonic time, MiB)
    fds: list[int] = field(default_factory=list)  # open file descriptors, sampled with the RSS
    crash_log: str = ""

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Slot:
    index: int
    span: tuple[int, int]
    incarnations: list[Incarnation] = field(default_factory=list)

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]


class Fleet:
    """The slots, their incarnations and the coverage of the blocks, thread-safe."""

    def __init__(
        self,
        swarm: LocalSwarm,
        model: str,
        num_blocks: int,
        spans: list[tuple[int, int]],
        peer_args: list[str],
        env: dict[str, str],
    ):
        self.swarm, self.model, self.num_blocks = swarm, model, num_blocks
        self.peer_args, self.env = peer_args, env
        self.slots = [Slot(i, span) for i, span in enumerate(spans)]
        self.kills: dict[str, int] = {"SIGKILL": 0, "SIGTERM": 0}
        self.crashes: list[Incarnation] = []
        self.uncovered_at: list[float] = []  # poll times when some block had no ONLINE peer, once all were up
        self._watching_coverage = False
        self._lock = threading.Lock()

    # --- starting and watching ---

    def start_all(self) -> None:
        with self._lock:
            for slot in self.slots:
                self._start(slot)

    def _start(self, slot: Slot) -> Incarnation:
        name = f"peer{slot.index}.{len(slot.incarnations)}"
        port = free_port()
        child = self.swarm.start_peer(
            name,
            self.model,
            "--blocks",
            f"{slot.span[0]}:{slot.span[1]}",
            "--port",
            str(port),
            *self.peer_args,
            env=self.env,
        )
        incarnation = Incarnation(name, slot.span, port, child.pid, time.monotonic())
        slot.incarnations.append(incarnation)
        return incarnation

    def wait_all_online(self, timeout_s: float) -> None:
        """Wait until every slot's current incarnation is ONLINE; from then on, coverage is watched."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            with self._lock:
                pending = [s.current.name for s in self.slots if s.current.online_at is None]
            if not pending:
                self._watching_coverage = True
                return
            time.sleep(0.5)
        raise TimeoutError(f"peers {pending} not ONLINE within {timeout_s:.0f}s; logs in {self.swarm.log_dir}")

    def poll(self) -> None:
        """Note new ONLINE incarnations and crashes (replacing the crashed), and whether every block is covered."""
        with self._lock:
            for slot in self.slots:
                current = slot.current
                child = self.swarm.children[current.name]
                if child.poll() is not None:
                    current.ended = f"crash (exit {child.returncode})"
                    current.crash_log = self.swarm.tail(current.name, 40)
                    self.crashes.append(current)
                    self.swarm.kill(current.name)  # whatever it left in its group (its DHT process)
                    self._start(slot)
                elif current.online_at is None and ONLINE_LINE in _read(self.swarm.log(current.name)):
                    current.online_at = time.monotonic()
            if self._watching_coverage and not self._covered(without=None):
                self.uncovered_at.append(time.monotonic())

    def _online(self) -> list[Slot]:
        return [s for s in self.slots if s.current.ended is None and s.current.online_at is not None]

    def _covered(self, without: Slot | None) -> bool:
        serving = [s.span for s in self._online() if s is not without]
        return all(any(a <= block < b for a, b in serving) for block in range(self.num_blocks))

    def online(self) -> list[Incarnation]:
        """The incarnations serving now (ONLINE, not being stopped)."""
        with self._lock:
            return [s.current for s in self._online()]

    def all_online(self) -> bool:
        with self._lock:
            return len(self._online()) == len(self.slots)

    def sample_rss(self) -> None:
        now = time.monotonic()
        for incarnation in self.online():
            try:
                process = psutil.Process(incarnation.pid)
                rss, fds = process.memory_info().rss / 2**20, process.num_fds()
            except psutil.Error:  # it died between the two calls
                continue
            incarnation.rss_mib.append((now, rss))
            incarnation.fds.append(fds)

    def watch(self, stop: threading.Event, rss_every_s: float, poll_every_s: float = 1.0) -> None:
        """poll() every second and sample_rss() every `rss_every_s` until `stop` (a thread's target)."""
        next_sample = 0.0
        while not stop.wait(poll_every_s):
            self.poll()
            if time.monotonic() >= next_sample:
                self.sample_rss()
                next_sample = time.monotonic() + rss_every_s

    # --- churn ---

    def kill_one(self, rng, sig: int, prefer: set[str] = frozenset()) -> Incarnation | None:
        """Stop a random slot's incarnation whose blocks other ONLINE peers serve, and start its replacement.

        Among those, one named in `prefer` is taken when there is one. Returns the stopped incarnation, or None
        when no slot can go without leaving a block unserved.
        """
        with self._lock:
            spare = [s for s in self._online() if self._covered(without=s)]
            if not spare:
                return None
            slot = rng.choice([s for s in spare if s.current.name in prefer] or spare)
            victim = slot.current
            victim.ended = signal.Signals(sig).name  # from here on poll() does not take its exit for a crash
            self.kills[victim.ended] += 1
            self._start(slot)  # the replacement starts at once, as a volunteer's restart would
        if sig == signal.SIGKILL:
            self.swarm.kill(victim.name)
            self.swarm.children[victim.name].wait()
        else:
            self.swarm.stop_child(victim.name)  # SIGTERM to the peer (it announces OFFLINE), then its group
        return victim

    def incarnations(self) -> list[Incarnation]:
        with self._lock:
            return [i for s in self.slots for i in s.incarnations]


def _read(path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
