"""`python -m bench.soak --minutes N`: churn, many clients and malformed traffic together, on 127.0.0.1.

A bootstrap node and several peers (overlapping spans, every block served by at least two; bench.soak_fleet)
serve a tiny random Llama built in a temporary folder (or `--model`: a checkpoint folder, or `default` for the
built-in default model). For N minutes, at once:

- churn: every few seconds a random peer whose blocks others also serve is SIGKILLed or SIGTERMed, and a
  fresh one starts in its place;
- clients (bench.soak_clients): threads generating back to back, greedy and (one of them) seeded sampling,
  each generation compared token for token with the local model's, computed before the peers started;
- malformed traffic (bench.soak_traffic): mutated and invalid requests to random peers.

Then, with every client shut down, each peer's Info must show no open session and its whole cache budget, and
no client channel (nor TCP connection to a peer) may be left open. The report gives generations completed,
wrong (tokens differ from the local model's), lost (an error reached the caller while every block was served),
the failovers and recoveries the clients went through, the answers to the bad requests, each peer process's
resident memory over time (first, last, max, slope) and what leaked. The exit code is 1 when a target is
missed: a wrong or lost generation, a leak, a peer that crashed, or an untyped answer to a bad request.
Every process is stopped on exit, Ctrl+C and failures included (process groups, through LocalSwarm).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from bench.soak_clients import Client, make_cases
from bench.soak_fleet import Fleet, Incarnation, overlapping_spans
from bench.soak_traffic import BadTraffic
from client.demo.local_swarm import LocalSwarm
from client.transport import ChannelPool
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import prefix_for_model
from swarm.models.checkpoint import load_config

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # peers on a busy 2-core machine: each imports torch and transformers
CLIENT_GRACE_S = 120.0  # a generation under way at the deadline may take this long to end
LEAK_WAIT_S = 20.0  # a peer frees a cancelled stream's session promptly, but not at once
MIN_SLOPE_MINUTES = 0.5  # a slope over less time says more about start-up than about leaks
CLIENT_OPTIONS = dict(request_timeout_s=20.0, wait_for_peers_s=60.0)


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """What one soak run does."""

    seconds: float
    """How long churn, clients and malformed traffic run together."""
    model: str | None = None
    """A checkpoint folder, "default" (the built-in default model), or None: a tiny random Llama."""
    peers: int = 4
    """Peers serving at once (>= 3); every block has at least two."""
    clients: int = 3
    """Client threads; one of them samples (seeded) when there are two or more, the others are greedy."""
    kill_every_s: tuple[float, float] = (5.0, 12.0)
    """A peer is stopped after a random wait in this range, again and again."""
    max_new_tokens: int = 24
    """Tokens per generation."""
    prompts: int = 6
    """Prompts per kind of client (greedy, sampled), with references computed up front and reused in turn."""
    bad_rate_per_s: float = 3.0
    """Malformed requests per second, on average."""
    rss_every_s: float = 5.0
    """How often each peer's resident memory is read."""
    cache_tokens: int = 4096
    """Each peer's --cache-tokens: what its Info must show left at the end."""
    seed: int = 0
    at_least: int = 0
    """Generations each client completes at the least: past `seconds` it goes on (no churn, no malformed traffic
    any more) until it has, for at most a minute; a loaded machine otherwise leaves too few to compare."""

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")
        if self.peers < 3 or self.clients < 1 or self.prompts < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"peers must be >= 3 and clients, prompts, max_new_tokens >= 1, got {self.peers}, "
                f"{self.clients}, {self.prompts}, {self.max_new_tokens}"
            )
        low, high = self.kill_every_s
        if not 0 < low <= high:
            raise ValueError(f"kill_every_s must be 0 < MIN <= MAX, got {self.kill_every_s}")
        if self.at_least < 0:
            raise ValueError(f"at_least must be >= 0, got {self.at_least}")
        if self.bad_rate_per_s < 0 or not self.rss_every_s > 0 or self.cache_tokens < 64:
            raise ValueError(
                f"bad_rate_per_s must be >= 0, rss_every_s > 0 and cache_tokens >= 64, got "
                f"{self.bad_rate_per_s}, {self.rss_every_s}, {self.cache_tokens}"
            )


def build_model(folder: Path) -> Path:
    """A tiny random Llama (hidden 64, GQA 4/2, 4 layers), seeded, with weights large enough for diverse tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


def resolve_model(name: str | None, workdir: Path) -> Path:
    if name is None:
        return build_model(workdir / "tiny-soak")
    if name == "default":
        from swarm.models.default_model import resolve_default_model
        from swarm.paths import default_cache_dir

        return resolve_default_model(default_cache_dir())
    return Path(name)


def make_references(model_path: Path, config: SoakConfig) -> tuple[list, list]:
    """Greedy and sampled cases, computed by the local model before any peer competes with it for the CPU."""
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    options = dict(max_new_tokens=config.max_new_tokens, seed=config.seed)
    greedy = make_cases(local, config.prompts, sampled=False, **options)
    sampled = make_cases(local, config.prompts, sampled=True, **options) if config.clients >= 2 else []
    return greedy, sampled


# --- the run ---


def run(config: SoakConfig, workdir: Path, log_dir: Path) -> dict:
    phases = {"start": time.monotonic()}
    # one thread: the tiny reference model runs faster so on a shared machine, and then the peers need the cores
    torch.set_num_threads(1)
    model_path = resolve_model(config.model, workdir)
    model_config = load_config(model_path)
    greedy, sampled = make_references(model_path, config)
    phases["references"] = time.monotonic()
    spans = overlapping_spans(model_config.num_hidden_layers, config.peers)
    peer_args = [
        "--transport",
        "direct",
        "--throughput",
        "100",
        "--num-threads",
        "1",
        "--cache-tokens",
        str(config.cache_tokens),
        "--cache-dir",
        str(workdir / "cache"),
        "--update-period-s",
        "10",
    ]
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "SWARMLM_LOG_LEVEL": "INFO",
    }
    rng = random.Random(config.seed)  # the victims
    stop = threading.Event()
    threads: list[threading.Thread] = []
    clients: list[Client] = []
    with LocalSwarm(log_dir) as swarm:
        try:
            swarm.start_bootstrap()
            fleet = Fleet(swarm, str(model_path), model_config.num_hidden_layers, spans, peer_args, env)
            fleet.start_all()
            fleet.wait_all_online(START_TIMEOUT_S)
            phases["starting peers"] = time.monotonic()
            threads.append(threading.Thread(target=fleet.watch, args=(stop, config.rss_every_s), daemon=True))
            threads[-1].start()
            for i in range(config.clients):
                cases = sampled if i == 1 else greedy  # the second client samples: one per process (see soak_clients)
                clients.append(
                    Client(
                        f"client{i}",
                        str(model_path),
                        swarm.initial_peers,
                        cases,
                        max_new_tokens=config.max_new_tokens,
                        stop=stop,
                        options=CLIENT_OPTIONS,
                    )
                )
            traffic = BadTraffic(
                fleet,
                prefix_for_model(str(model_path)),
                model_config.hidden_size,
                model_config.max_position_embeddings,
                config.seed,
            )
            began = phases["starting clients"] = time.monotonic()
            deadline = began + config.seconds
            for client in clients:
                client.deadline, client.at_least = deadline, config.at_least
                client.start()
            if config.bad_rate_per_s > 0:
                threads.append(
                    threading.Thread(
                        target=lambda: asyncio.run(traffic.run(config.bad_rate_per_s, deadline, stop)), daemon=True
                    )
                )
                threads[-1].start()
            _churn(fleet, rng, config.kill_every_s, deadline, stop)
            for client in clients:
                client.join(max(1.0, deadline + CLIENT_GRACE_S - time.monotonic()))
                client.tally.hung = client.is_alive()
            elapsed = time.monotonic() - began
            phases["soak"] = time.monotonic()
            if len(threads) > 1:
                threads[1].join(30.0)
            leaks = _check_leaks(fleet, config.cache_tokens)
            stop.set()
            threads[0].join(10.0)
            phases["checks"] = time.monotonic()
            result = _summary(config, model_path, spans, fleet, clients, traffic, leaks, elapsed)
        finally:
            stop.set()
            for client in clients:  # each ends its generation under way and closes itself; a hung one is left
                if client.ident is not None:
                    client.join(CLIENT_GRACE_S / 4)
                if not client.is_alive():
                    client.close()  # what a client that never started holds
    phases["stopping"] = time.monotonic()
    names = list(phases)  # each phase's end
    result["phase_s"] = {names[i + 1]: round(phases[names[i + 1]] - phases[names[i]], 1) for i in range(len(names) - 1)}
    return result


def _churn(
    fleet: Fleet, rng: random.Random, every_s: tuple[float, float], deadline: float, stop: threading.Event
) -> None:
    """Stop a peer at random intervals until `deadline`, SIGKILL and SIGTERM in turn (SIGKILL first).

    Two stops in four (a SIGKILL and a SIGTERM) take a peer with open sessions when one can go, so that sessions
    are repaired mid-way, not only opened elsewhere (clients route through the fewest hops, which random stops
    often spare).
    """
    signals = [signal.SIGKILL, signal.SIGTERM]
    wait_s = rng.uniform(*every_s)
    while not stop.wait(min(wait_s, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return
        stops = sum(fleet.kills.values())
        sig = signals[stops % 2]
        busy = _busy(fleet.online()) if stops % 4 < 2 else set()
        victim = fleet.kill_one(rng, sig, prefer=busy)
        if victim is None:  # replacements are still starting: every remaining peer is needed for now
            wait_s = 1.0
            continue
        logger.info("%s %s (blocks %d:%d)", sig.name, victim.name, *victim.span)
        wait_s = rng.uniform(*every_s)


def _busy(online: list[Incarnation]) -> set[str]:
    """Names of the peers whose Info shows the most open sessions now (none if no peer has one)."""
    sessions = {p["peer"]: p.get("open_sessions", 0) for p in asyncio.run(_infos(online, cache_tokens=0, wait_s=0.0))}
    most = max(sessions.values(), default=0)
    return {name for name, count in sessions.items() if count == most > 0}


def _check_leaks(fleet: Fleet, cache_tokens: int) -> dict:
    """Every ONLINE peer's sessions and cache once the clients are gone, and this process's connections to peers.

    A replacement still starting is not asked: it never announced itself, so nobody could have used it.
    """
    fleet.poll()
    online = fleet.online()
    peers = asyncio.run(_infos(online, cache_tokens))
    ports = {i.port for i in fleet.incarnations()}
    # a finished gRPC call caught in a reference cycle (call -> its error -> traceback -> frame -> call) keeps its
    # connection open even after its channel is closed, until the cycle collector runs: count what live objects hold
    gc.collect()
    connections = _connections_to(ports)
    for _ in range(20):  # gRPC closes a channel's sockets shortly after close()
        if not connections:
            break
        time.sleep(0.25)
        connections = _connections_to(ports)
    starting = [s.current.name for s in fleet.slots if s.current not in online]
    by_port = {i.port: i for i in fleet.incarnations()}
    open_to = [
        f"{c.laddr.port} -> {by_port[c.raddr.port].name} ({by_port[c.raddr.port].ended or 'running'})"
        for c in connections
    ]
    return {"peers": peers, "tcp_connections": len(connections), "open_to": open_to, "starting": starting}


async def _infos(online: list[Incarnation], cache_tokens: int, wait_s: float = LEAK_WAIT_S) -> list[dict]:
    """Each peer's Info, asked again every second for up to `wait_s` until none shows a session or used cache."""
    pool = ChannelPool(1 << 24)
    try:
        found = {}
        deadline = time.monotonic() + wait_s
        while True:
            for incarnation in online:
                try:
                    info = await pool.unary(incarnation.endpoint, "info", pb.InfoRequest(), 5.0)
                    found[incarnation.name] = dict(
                        peer=incarnation.name,
                        open_sessions=info.open_sessions,
                        cache_tokens_left=info.cache_tokens_left,
                        cache_tokens=cache_tokens,
                    )
                except SwarmError as exc:
                    found[incarnation.name] = dict(peer=incarnation.name, error=str(exc)[:300])
            clean = all(
                p.get("open_sessions") == 0 and p.get("cache_tokens_left") == cache_tokens for p in found.values()
            )
            if clean or time.monotonic() > deadline:
                return list(found.values())
            await asyncio.sleep(1.0)
    finally:
        await pool.close()


def _connections_to(ports: set[int]) -> list:
    return [
        c
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED
    ]


# --- figures ---


def rss_figures(incarnation: Incarnation) -> dict:
    """First, last and max resident MiB of one peer process, and least-squares slopes in MiB per minute.

    `slope` runs over all its samples; `late_slope` over its second half, past the growth of its first requests
    (buffers and allocator pools reach their working size), which is what a leak would keep going.
    """
    samples = incarnation.rss_mib
    figures = dict(
        peer=incarnation.name,
        span=f"{incarnation.span[0]}:{incarnation.span[1]}",
        ended=incarnation.ended or "running",
        samples=len(samples),
    )
    if not samples:
        return figures
    t0 = samples[0][0]
    points = [((t - t0) / 60, v) for t, v in samples]
    values = [v for _, v in samples]
    half = points[-1][0] / 2
    figures.update(
        first_mib=round(values[0], 1),
        last_mib=round(values[-1], 1),
        max_mib=round(max(values), 1),
        minutes=round(points[-1][0], 2),
        first_fds=incarnation.fds[0] if incarnation.fds else None,
        last_fds=incarnation.fds[-1] if incarnation.fds else None,
        max_fds=max(incarnation.fds, default=None),
        slope_mib_per_min=_slope(points),
        late_slope_mib_per_min=_slope([p for p in points if p[0] >= half], MIN_SLOPE_MINUTES / 2),
        series=[(round(t * 60, 1), round(v, 1)) for t, v in points],
    )  # (seconds since its first, MiB)
    return figures


def _slope(points: list[tuple[float, float]], min_minutes: float = MIN_SLOPE_MINUTES) -> float | None:
    if len(points) < 3 or points[-1][0] - points[0][0] < min_minutes:
        return None
    mean_t, mean_v = sum(t for t, _ in points) / len(points), sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return round(sum((t - mean_t) * (v - mean_v) for t, v in points) / var, 2)


def _summary(
    config: SoakConfig,
    model_path: Path,
    spans,
    fleet: Fleet,
    clients: list[Client],
    traffic: BadTraffic,
    leaks: dict,
    elapsed: float,
) -> dict:
    errors = [(c.name, began, ended, what) for c in clients for began, ended, what in c.tally.errors]
    # an error is a loss unless some block had no ONLINE peer while that generation ran (the churn avoids it)
    lost = [e for e in errors if not any(e[1] - 1.0 <= t <= e[2] for t in fleet.uncovered_at)]
    lost_count = len(lost) + sum(c.tally.hung for c in clients)
    peers = leaks["peers"]
    sessions = sum(p.get("open_sessions", 0) for p in peers)
    cache = sum(p["cache_tokens"] - p["cache_tokens_left"] for p in peers if "cache_tokens_left" in p)
    channels = sum(c.tally.channels_after_close or 0 for c in clients)
    unchecked = sum("error" in p for p in peers)
    leaked = sessions + max(0, cache) + channels + leaks["tcp_connections"] + unchecked
    outcomes = dict(traffic.tally.outcomes)
    result = {
        "config": {**asdict(config), "model": str(model_path)},
        "seconds": round(elapsed, 1),
        "spans": [f"{a}:{b}" for a, b in spans],
        "generations": {
            "completed": sum(c.tally.completed for c in clients),
            "wrong": sum(c.tally.wrong for c in clients),
            "lost": lost_count,
            "errors_while_uncovered": len(errors) - len(lost),
            "greedy": sum(c.tally.completed for c in clients if not c.tally.sampling),
            "sampled": sum(c.tally.completed for c in clients if c.tally.sampling),
            "failovers": sum(c.tally.failovers for c in clients),
            "recoveries": sum(c.tally.recoveries for c in clients),
            "hung_clients": [c.name for c in clients if c.tally.hung],
            "mismatches": [m for c in clients for m in c.tally.mismatches],
            "lost_errors": [f"{name} at {began - _fleet_start(fleet):.1f}s: {what}" for name, began, _, what in lost][
                :10
            ],
        },
        "churn": {
            "kills": dict(fleet.kills),
            "incarnations": len(fleet.incarnations()),
            "crashes": len(fleet.crashes),
            "crash_logs": {i.name: i.crash_log for i in fleet.crashes},
            "uncovered_polls": len(fleet.uncovered_at),
        },
        "traffic": {
            "sent": sum(outcomes.values()),
            "outcomes": outcomes,
            "by_kind": {f"{k}/{o}": n for (k, o), n in sorted(traffic.tally.by_kind.items())},
            "untyped_examples": traffic.tally.untyped,
        },
        "rss": [rss_figures(i) for i in fleet.incarnations()],
        "leaks": {
            "sessions": sessions,
            "cache_tokens": cache,
            "client_channels": channels,
            "tcp_connections": leaks["tcp_connections"],
            "connections_open_to": leaks["open_to"],
            "peers_unchecked": unchecked,
            "peers": peers,
            "peers_starting": leaks["starting"],
        },
    }
    result["missed"] = [
        name
        for name, bad in [
            ("wrong", result["generations"]["wrong"]),
            ("lost", lost_count),
            ("leaked", leaked),
            ("crashes", len(fleet.crashes)),
            ("untyped", outcomes.get("untyped", 0)),
            ("nothing completed", result["generations"]["completed"] == 0),
        ]
        if bad
    ]
    return result


def _fleet_start(fleet: Fleet) -> float:
    return min(i.started for i in fleet.incarnations())


def report(result: dict) -> str:
    g, c, t, leaks = result["generations"], result["churn"], result["traffic"], result["leaks"]
    kills = ", ".join(f"{n} {sig}" for sig, n in c["kills"].items())
    lines = [
        f"soak: {result['seconds']} s, peers on blocks {' '.join(result['spans'])} of {result['config']['model']}",
        f"{'generations completed':<28}{g['completed']:>8}  ({g['greedy']} greedy, {g['sampled']} sampled)",
        f"{'wrong (target 0)':<28}{g['wrong']:>8}",
        f"{'lost (target 0)':<28}{g['lost']:>8}  (errors while a block was unserved: {g['errors_while_uncovered']})",
        f"{'failovers / recoveries':<28}{g['failovers']:>8} / {g['recoveries']}",
        f"{'peers stopped':<28}{sum(c['kills'].values()):>8}  ({kills}; {c['incarnations']} processes in all)",
        f"{'peer crashes (target 0)':<28}{c['crashes']:>8}",
        f"{'bad requests':<28}{t['sent']:>8}  " + ", ".join(f"{o} {n}" for o, n in sorted(t["outcomes"].items())),
        f"{'leaked sessions (target 0)':<28}{leaks['sessions']:>8}",
        f"{'leaked cache tokens':<28}{leaks['cache_tokens']:>8}",
        f"{'leaked client channels':<28}{leaks['client_channels']:>8}  "
        f"(TCP connections to peers after close: {leaks['tcp_connections']})",
        f"{'peers checked at the end':<28}{len(leaks['peers']):>8}  (unanswered: {leaks['peers_unchecked']}; "
        f"still starting, never served: {len(leaks['peers_starting'])})",
        "",
        f"{'peer process':<12}{'blocks':>7}{'ended':>12}{'samples':>9}{'first':>8}{'last':>8}{'max':>8}{'mins':>7}"
        f"{'MiB/min':>9}{'late':>7}{'fds':>14}   (RSS in MiB, slope over all samples and over the second half; "
        f"open fds first/last/max)",
    ]
    for r in result["rss"]:
        if not r["samples"]:
            lines.append(f"{r['peer']:<12}{r['span']:>7}{r['ended']:>12}{0:>9}")
            continue
        slope, late = (
            ("-" if v is None else f"{v:+.1f}") for v in (r["slope_mib_per_min"], r["late_slope_mib_per_min"])
        )
        lines.append(
            f"{r['peer']:<12}{r['span']:>7}{r['ended']:>12}{r['samples']:>9}{r['first_mib']:>8.0f}"
            f"{r['last_mib']:>8.0f}{r['max_mib']:>8.0f}{r['minutes']:>7.1f}{slope:>9}{late:>7}"
            f"{r['first_fds']:>6}/{r['last_fds']}/{r['max_fds']}"
        )
    lines += [f"  wrong: {m}" for m in g["mismatches"]] + [f"  lost: {e}" for e in g["lost_errors"]]
    lines += [f"  hung client: {name}" for name in g["hung_clients"]]
    lines += [f"  untyped answer: {u}" for u in t["untyped_examples"]]
    lines += [f"  unchecked peer: {p}" for p in leaks["peers"] if "error" in p]
    lines += [f"  connection still open: {c}" for c in leaks["connections_open_to"]]
    for name, log in c["crash_logs"].items():
        lines.append(f"  crashed {name}:\n{log}")
    lines.append("seconds spent: " + ", ".join(f"{name} {s:.0f}" for name, s in result.get("phase_s", {}).items()))
    lines.append("all targets met" if not result["missed"] else f"MISSED: {', '.join(result['missed'])}")
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    length = p.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=10.0, help="how long to soak (default: 10)")
    length.add_argument("--seconds", type=float, help="how long to soak, in seconds instead")
    p.add_argument(
        "--model",
        help="a checkpoint folder, or `default` for the built-in default model "
        "(default: a tiny random Llama built in a temporary folder)",
    )
    p.add_argument("--peers", type=int, default=4, help="peers at once, >= 3 (default: 4)")
    p.add_argument("--clients", type=int, default=3, help="client threads, one of them sampling (default: 3)")
    p.add_argument(
        "--kill-every-s",
        type=float,
        nargs=2,
        default=(5.0, 12.0),
        metavar=("MIN_S", "MAX_S"),
        help="seconds between peer stops, drawn in this range (default: 5 12)",
    )
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per generation (default: 24)")
    p.add_argument(
        "--prompts", type=int, default=6, help="prompts per kind (greedy, sampled), reused in turn (default: 6)"
    )
    p.add_argument("--bad-rate", type=float, default=3.0, help="malformed requests per second (default: 3)")
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples (default: 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, churn and mutations (default: 0)")
    p.add_argument(
        "--at-least",
        type=int,
        default=0,
        metavar="N",
        help="generations each client completes at the least, going on past the soak's time if need be (default: 0)",
    )
    p.add_argument("--log-dir", type=Path, help="keep the processes' logs here (default: a temporary folder)")
    p.add_argument(
        "--out", type=Path, metavar="PATH", help="also write the figures as JSON to this file (in a folder: soak.json)"
    )
    args = p.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        args.out = args.out / "soak.json"
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out: folder {args.out.parent} does not exist")
    try:
        config = SoakConfig(
            seconds=args.seconds if args.seconds is not None else 60 * args.minutes,
            model=args.model,
            peers=args.peers,
            clients=args.clients,
            kill_every_s=tuple(args.kill_every_s),
            max_new_tokens=args.max_new_tokens,
            prompts=args.prompts,
            bad_rate_per_s=args.bad_rate,
            rss_every_s=args.rss_every,
            seed=args.seed,
            at_least=args.at_least,
        )
    except ValueError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    logging.getLogger("client").setLevel(logging.ERROR)  # failovers are expected here; the report counts them
    signal.signal(signal.SIGTERM, _interrupt)  # stop like Ctrl+C: through LocalSwarm's cleanup
    with tempfile.TemporaryDirectory(prefix="swarmlm-soak-") as workdir:
        log_dir = args.log_dir or Path(workdir) / "logs"
        try:
            result = run(config, Path(workdir), log_dir)
        except KeyboardInterrupt:
            print("interrupted; every process was stopped", file=sys.stderr)
            return 130
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if result["missed"] else 0


if __name__ == "__main__":
    sys.exit(main())
