"""One model's swarm on this machine: a bootstrap node, splits of its blocks into 1..3 peers, a client each.

Peers are real `swarmlm peer` processes on 127.0.0.1 started by LocalSwarm, one after the other so each
start-up is timed alone; a split's peers are stopped (SIGTERM, then SIGKILL to the group) before the next
split starts, and everything is stopped on the way out, also on errors.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import memory
from bench.models import BenchModel, load_reference
from bench.plan import Plan
from bench.proxy import DelayProxy
from bench.train_runs import free_port
from client.demo.local_swarm import LocalSwarm, split_blocks
from client.model import AutoDistributedModelForCausalLM, DistributedModelForCausalLM
from protocol import swarmlm_pb2 as pb

logger = logging.getLogger(__name__)

_ONLINE_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 15.0


@dataclass
class PeerStart:
    """One peer of a split: its span, how long it took to be ONLINE, its memory then and at the end."""

    name: str
    span: tuple[int, int]
    pid: int
    startup_s: float
    rss_mib: dict[str, float]
    """Resident memory at named moments: "at ONLINE", "after decode", "at the end"."""
    children_online_mib: dict[str, float]
    gpu_online_mib: float | None = None
    peak_rss_mib: float | None = None
    peak_by_moment_mib: dict[str, float | None] = field(default_factory=dict)
    """The high-water mark as it was after each scenario: which one raised it."""


@dataclass
class Split:
    count: int
    prefix: str
    spans: list[tuple[int, int]]
    peers: list[PeerStart] = field(default_factory=list)
    client: DistributedModelForCausalLM | None = None
    proxies: list[DelayProxy] = field(default_factory=list)
    """With `split(delayed=True)`: each peer's delaying proxy, which it announces (set `delay_s` to change it)."""


class ModelRun:
    """`with ModelRun(model, plan, log_dir) as run:` then `with run.split(3) as split:` to use `split.client`."""

    def __init__(self, model: BenchModel, plan: Plan, log_dir: Path):
        self.model, self.plan, self.log_dir = model, plan, log_dir
        self.swarm = LocalSwarm(log_dir)
        self._reference: torch.nn.Module | None = None

    def __enter__(self) -> ModelRun:
        self.swarm.__enter__()
        try:
            self.swarm.start_bootstrap()
            # start the swarm's own DHT client now, so that it is not counted in the first peer's startup
            self.swarm.wait_online(str(self.model.path), self.model.num_blocks, [], dht_prefix="bench-warm-up")
        except BaseException:
            self.swarm.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.swarm.stop()

    @property
    def reference(self) -> torch.nn.Module:
        """The whole model, local, same checkpoint and dtype (loaded once)."""
        if self._reference is None:
            self._reference = load_reference(self.model, dtype=self.plan.dtype, device=self.plan.device)
        return self._reference

    @property
    def client_dtype(self) -> str:
        # the client keeps embeddings and head on the CPU: compute them in float32 there
        return self.plan.dtype if self.plan.device == "cpu" else "float32"

    def cache_tokens(self) -> int:
        p = self.plan
        longest = max(max(p.prefill_lengths), p.decode_prompt + p.decode_steps + 1)
        clients = max(p.concurrency_clients) * (p.decode_prompt + p.concurrency_steps + 1)
        return max(8192, 2 * longest, 2 * clients)

    def _peer_args(self, prefix: str, start: int, end: int) -> list[str]:
        p = self.plan
        return [
            "--blocks",
            f"{start}:{end}",
            "--num-threads",
            str(p.peer_threads),
            "--throughput",
            "1000",
            "--dht-prefix",
            prefix,
            "--device",
            p.device,
            "--dtype",
            p.dtype,
            "--cache-tokens",
            str(self.cache_tokens()),
            "--cache-dir",
            str(self.log_dir / "peer-cache"),
        ]

    def _start_peer(self, name: str, prefix: str, span: tuple[int, int], listen: tuple[str, ...] = ()) -> PeerStart:
        began = time.monotonic()
        # explicit either way: the local swarm defaults to PASSIVE, and this process's own policy is in os.environ
        env = {"OMP_WAIT_POLICY": "PASSIVE" if self.plan.peer_omp_passive else ""}  # "": libgomp's own policy
        child = self.swarm.start_peer(name, str(self.model.path), *self._peer_args(prefix, *span), *listen, env=env)
        self.swarm.wait_online(
            str(self.model.path), self.model.num_blocks, [span], dht_prefix=prefix, timeout_s=_ONLINE_TIMEOUT_S
        )
        startup = time.monotonic() - began
        gpu = memory.gpu_mib_by_pid().get(child.pid) if self.plan.device == "cuda" else None
        return PeerStart(
            name,
            span,
            child.pid,
            startup,
            {"at ONLINE": memory.rss_mib(child.pid)},
            memory.children_rss_mib(child.pid),
            gpu,
        )

    @staticmethod
    def note_memory(split: Split, moment: str) -> None:
        """Record each peer's resident memory and its high-water mark so far, under `moment`."""
        for peer in split.peers:
            with contextlib.suppress(Exception):
                peer.rss_mib[moment] = memory.rss_mib(peer.pid)
                peer.peak_by_moment_mib[moment] = memory.peak_rss_mib(peer.pid)

    @contextlib.contextmanager
    def split(self, count: int, delayed: bool = False) -> Iterator[Split]:
        """The model's blocks split over `count` fresh peers, and a client connected to them. `delayed`: each peer
        is announced behind a DelayProxy of its own (delay 0 until set), so that every connection to it, from the
        client or from another peer, pays the delay (bench/proxy.py)."""
        count = max(1, min(count, self.model.num_blocks))
        prefix = f"bench-{self.model.name}-{count}p" + ("-delayed" if delayed else "")
        split = Split(count, prefix, split_blocks(self.model.num_blocks, count))
        try:
            for i, span in enumerate(split.spans):
                listen: tuple[str, ...] = ()
                if delayed:
                    port = free_port()
                    split.proxies.append(DelayProxy(f"127.0.0.1:{port}", 0.0))
                    listen = ("--port", str(port), "--announce-host", split.proxies[-1].start())
                split.peers.append(self._start_peer(f"{prefix}-{i}", prefix, span, listen))
                logger.info(
                    "%s: peer %d (blocks %d:%d) ONLINE after %.1fs",
                    self.model.name,
                    i,
                    *span,
                    split.peers[-1].startup_s,
                )
            split.client = self.connect(prefix)
            yield split
        finally:
            if split.client is not None:
                try:
                    split.client.shutdown()
                except Exception:  # the peers are stopped below all the same
                    logger.exception("closing the client of the %d-peer split failed", count)
            self.note_memory(split, "at the end")
            for peer in split.peers:
                with contextlib.suppress(Exception):
                    peer.peak_rss_mib = memory.peak_rss_mib(peer.pid)
            began = time.monotonic()
            self._stop_peers([f"{prefix}-{i}" for i in range(len(split.spans))])
            for proxy in split.proxies:
                proxy.close()
            logger.info("%s: stopped the %d-peer split in %.1fs", self.model.name, count, time.monotonic() - began)

    def connect(self, prefix: str, **options) -> DistributedModelForCausalLM:
        """A client of the model's peers under `prefix` (`options`: ClientConfig fields); the caller shuts it down."""
        return AutoDistributedModelForCausalLM.from_pretrained(
            str(self.model.path),
            initial_peers=self.swarm.initial_peers,
            dht_prefix=prefix,
            dtype=self.client_dtype,
            directory_refresh_s=3600.0,
            **options,
        )

    def _stop_peers(self, names: list[str]) -> None:
        """SIGTERM the peers (they announce OFFLINE), then SIGKILL whatever is left of their process groups."""
        present = [name for name in names if name in self.swarm.children]
        for name in present:
            self.swarm.children[name].send_signal(signal.SIGTERM)  # the peer itself: it then stops its DHT
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for name in present:
            child = self.swarm.children[name]
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(max(0.1, deadline - time.monotonic()))
            self.swarm.kill(name, signal.SIGKILL)
            child.wait()
            # a stopped peer must not count as a crash when the next split waits for its peers
            del self.swarm.children[name]


async def peer_infos(client) -> dict[str, pb.InfoResponse]:
    """Peer id -> Info answer of each online peer of the client's model (counters and timings since its start)."""
    snapshot = await client.sequence.snapshot(refresh=True)
    return {
        peer_id: await client.sequence.pool.unary(
            client.sequence.paths.get(peer_id, info.endpoint), "info", pb.InfoRequest(), 10.0
        )
        for peer_id, info in snapshot.online().items()
    }


def sync_for(device: str):
    """A function that waits for queued device work (CUDA) before a clock is read."""
    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None
