"""The processes and logs of the train_swarm scenario: its model, training peers, `swarmlm train` runs, and what
their logs say.

- build_train_model: a small random Llama with the default model's tokenizer, saved once
- TrainSettings: what every `swarmlm train` run of one comparison shares (the swarm's and the --local one)
- start_training_peers / run_trainers: real processes through a LocalSwarm, each stopped when done or on errors
- bare_allreduce_s: two bare hivemind DecentralizedAveragers averaging a stage's worth of tensors, timed
- the rest are pure functions over log lines and per-step records (tested with plain data)
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from client.demo.local_swarm import LocalSwarm
from swarm.models.default_model import resolve_default_model

logger = logging.getLogger(__name__)

TRAIN_MODEL = "train-small"
TRAIN_SPEC = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    initializer_range=0.02,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)
"""The random Llama of the fidelity runs; its vocabulary is the default model's tokenizer's (49152)."""
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
# a stage peer's round (peer/training/span.py): "update N of run 'R': averaged S samples (H here) among M members in Ts"
# a round of gradients, or a sync of a run with local steps (peer/training/span.py)
_ROUND = re.compile(
    r"(?:averaged \d+ samples \(\d+ here\)|synced) among (\d+) members in ([0-9.]+)s(?:, (\d+) bytes sent)?"
)
_ONLINE = "ONLINE: serving blocks"
_UPDATE = re.compile(r"update (\d+) of run '([^']*)': averaged")


def build_train_model(
    models_dir: Path,
    cache_dir: Path,
    seed: int = 0,
    *,
    name: str = TRAIN_MODEL,
    config: dict | None = None,
    char_tokenizer: bool = False,
) -> Path:
    """Build (once) the random Llama `config` (default TRAIN_SPEC) in `models_dir / name`, with the default model's
    tokenizer files, or with the tests' 128-character tokenizer (`char_tokenizer`: a tiny vocabulary, so the
    trainers' head costs next to nothing); returns its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if char_tokenizer:
        from tests.helpers.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_char_tokenizer

        source, ids = None, {"vocab_size": 128, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    else:
        source = resolve_default_model(cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(source)
        ids = {
            "vocab_size": len(tokenizer),
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    spec = {
        "name": name,
        "seed": seed,
        "tokenizer": "char" if source is None else source.name,
        "config": {**(config or TRAIN_SPEC), **ids},
    }
    folder = models_dir / name
    marker = folder / "bench-spec.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec and any(folder.glob("*.safetensors")):
        return folder
    logger.info("building the random model %s in %s", name, folder)
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models_dir))
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**spec["config"]), dtype=torch.float32)
        model.save_pretrained(staging, safe_serialization=True)
        if source is None:
            save_char_tokenizer(staging)
        else:
            for file in _TOKENIZER_FILES:
                if (source / file).is_file():
                    shutil.copy2(source / file, staging / file)
        (staging / "bench-spec.json").write_text(json.dumps(spec, indent=1))
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    """What the runs of one comparison share; `args()` turns it into `swarmlm train` flags."""

    seq_len: int
    """Tokens per sequence."""
    batch_size: int
    """Sequences per step of one trainer."""
    micro_batch_size: int
    """Sequences per request through the peers."""
    steps: int
    """Optimizer steps of each run."""
    lr: float = 1e-3
    """Learning rate of the trainers and the peers."""
    matchmaking_time_s: float = 1.0
    """Gathering time of every averaging round (loopback peers gather at once)."""
    averaging_timeout_s: float = 15.0
    """A round not done in this long falls back to local gradients."""

    def averaging_args(self) -> list[str]:
        return [
            "--matchmaking-time-s",
            f"{self.matchmaking_time_s:g}",
            "--averaging-timeout-s",
            f"{self.averaging_timeout_s:g}",
        ]

    def args(self, *, seed: int = 0, batch_size: int | None = None, max_in_flight: int = 0) -> list[str]:
        return [
            "--seq-len",
            str(self.seq_len),
            "--batch-size",
            str(batch_size or self.batch_size),
            "--micro-batch-size",
            str(self.micro_batch_size),
            "--steps",
            str(self.steps),
            "--lr",
            f"{self.lr:g}",
            "--seed",
            str(seed),
            "--max-in-flight",
            str(max_in_flight),
            "--no-progress",
            *self.averaging_args(),
        ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_name(prefix: str, index: int) -> str:
    return f"{prefix}-peer{index}"


def start_training_peers(
    swarm: LocalSwarm,
    model: Path,
    num_blocks: int,
    *,
    prefix: str,
    run_id: str,
    spans: list[tuple[int, int]],
    target_batch: int,
    settings: TrainSettings,
    threads: int,
    device: str,
    ports: list[tuple[int, str]] | None = None,
    online_timeout_s: float = 240.0,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """Start a training peer per span (all at once) and wait until all are ONLINE; returns their names.

    `ports`, one (port, announced "host:port") per span, puts each peer behind a proxy that clients dial; `extra`
    are more flags for every peer.
    """
    names = []
    for i, (start, end) in enumerate(spans):
        name = peer_name(prefix, i)
        listen = ["--port", str(ports[i][0]), "--announce-host", ports[i][1]] if ports else []
        swarm.start_peer(
            name,
            str(model),
            "--blocks",
            f"{start}:{end}",
            "--dht-prefix",
            prefix,
            "--num-threads",
            str(threads),
            "--throughput",
            "1000",
            "--device",
            device,
            "--dtype",
            "float32",
            "--cache-dir",
            str(swarm.log_dir / "peer-cache"),
            *listen,
            "--train",
            "--run-id",
            run_id,
            "--lr",
            f"{settings.lr:g}",
            "--target-batch-size",
            str(target_batch),
            *settings.averaging_args(),
            *extra,
        )
        names.append(name)
    deadline = time.monotonic() + online_timeout_s
    swarm.wait_online(str(model), num_blocks, sorted(set(spans)), dht_prefix=prefix, timeout_s=online_timeout_s)
    # wait_online sees a span served once; with two peers a span, each peer must say it is ONLINE
    while not all(_ONLINE in swarm.log(name).read_text() for name in names):
        for name in names:
            if swarm.children[name].poll() is not None:
                raise RuntimeError(f"{name} exited with code {swarm.children[name].returncode}: {swarm.tail(name)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"peers of {prefix} not ONLINE within {online_timeout_s:.0f}s; logs in {swarm.log_dir}")
        time.sleep(0.3)
    return names


def run_trainers(swarm: LocalSwarm, runs: dict[str, list[str]], *, timeout_s: float) -> dict[str, list[dict]]:
    """Run `swarmlm train ARGS --log-json LOG` for each name at once; returns each run's step records.

    Raises RuntimeError (with the log's tail) when a run fails or outlasts `timeout_s`; every run is stopped.
    """
    logs = {name: swarm.log_dir / f"{name}.jsonl" for name in runs}
    try:
        for name, args in runs.items():
            logs[name].unlink(missing_ok=True)
            swarm.start(name, "train", *args, "--log-json", str(logs[name]))
        deadline = time.monotonic() + timeout_s
        for name in runs:
            try:
                code = swarm.children[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name} did not finish within {timeout_s:.0f}s: {swarm.tail(name)}") from None
            if code != 0:
                raise RuntimeError(f"{name} exited with code {code}: {swarm.tail(name)}")
    finally:
        for name in runs:
            if name in swarm.children:  # a finished run must not count as a crash in later waits
                swarm.stop_child(name)
    return {name: read_steps(logs[name]) for name in runs}


def stop_peers(swarm: LocalSwarm, names: list[str]) -> None:
    """SIGTERM all at once (they leave their groups), then stop each (SIGKILL to what is left)."""
    for name in names:
        if name in swarm.children and swarm.children[name].poll() is None:
            swarm.children[name].send_signal(signal.SIGTERM)
    for name in names:
        if name in swarm.children:
            swarm.stop_child(name)


def stage_tensor_shapes(model: Path, span: tuple[int, int]) -> list[tuple[int, ...]]:
    """Shapes of the parameters of blocks [start, end) in the checkpoint (read from its header)."""
    from safetensors import safe_open

    shapes = []
    wanted = tuple(f"model.layers.{i}." for i in range(*span))
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes += [tuple(f.get_slice(key).get_shape()) for key in sorted(f.keys()) if key.startswith(wanted)]
    return shapes


def bare_allreduce_s(
    tensors: list[tuple[tuple[int, ...], torch.dtype]],
    *,
    rounds: int,
    matchmaking_time_s: float,
    averaging_timeout_s: float,
) -> tuple[list[float], int]:
    """Seconds of each averager's step() over `rounds` successful rounds of two bare averagers, and the failed ones.

    `tensors` are (shape, dtype) pairs. Each averager has a plain hivemind DHT node of its own, the second joined
    to the first (ours refuse hivemind's matchmaking records); both call step() at the same moment from two threads, with hivemind's own matchmaking at its quickest (a
    target group size of 2), which a stage's round replaces by a known group (swarm/training/rounds.py).
    Rounds until the first success are a warm-up (the averagers find each other in the DHT), not counted.
    """
    from hivemind.averaging import DecentralizedAverager
    from hivemind.utils import get_dht_time

    from swarm.dht.node import start_plain_dht, stop_dht, visible_maddrs

    dhts, averagers = [], []
    handler = signal.getsignal(signal.SIGINT)  # hivemind's averager ignores SIGINT here before it forks
    try:
        prefix = f"bench_bare_allreduce_{get_dht_time():.0f}"
        for _ in range(2):
            dhts.append(start_plain_dht(visible_maddrs(dhts[0]) if dhts else ()))
            averagers.append(
                DecentralizedAverager(
                    [torch.randn(shape, dtype=dtype) for shape, dtype in tensors],
                    dhts[-1],
                    prefix=prefix,
                    start=True,
                    min_group_size=2,
                    target_group_size=2,  # the group starts once both joined: hivemind at its fastest, as our rounds
                    min_matchmaking_time=matchmaking_time_s,
                    request_timeout=0.5,
                    allreduce_timeout=averaging_timeout_s,
                    shutdown_timeout=2,
                )
            )
        find_s = min(averaging_timeout_s, 3 * matchmaking_time_s)  # as a training group gives up finding its own
        times: list[float] = []
        failed, warm = 0, False
        for _ in range(2 * rounds + 5):
            took = _both_step(averagers, find_s, averaging_timeout_s)
            if None not in took and warm:
                times += took
            elif None in took and warm:
                failed += 1
            warm = warm or None not in took
            if len(times) >= 2 * rounds:
                return times, failed
        raise RuntimeError(
            f"bare averagers completed {len(times) // 2} of {rounds} rounds "
            f"({'after' if warm else 'and no'} warm-up round); see the log for hivemind's errors"
        )
    finally:
        if threading.current_thread() is threading.main_thread() and handler is not None:
            signal.signal(signal.SIGINT, handler)
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in dhts:
            stop_dht(dht)


def known_round_s(
    initial_peers: list[str], tensors: list[tuple[tuple[int, ...], torch.dtype]], *, rounds: int, timeout_s: float
) -> tuple[list[float], int]:
    """Seconds of each member's average() over `rounds` rounds of two RoundAveragers (what a stage's group runs), and
    the failed ones: under the conditions of bare_allreduce_s (a DHT node each, both released at once from two
    threads of this process), so that the two compare the mechanisms alone. The first round is a warm-up."""
    from swarm.dht.node import start_dht, stop_dht
    from swarm.training.rounds import RoundAverager, RoundSettings

    dhts, averagers = [], []
    prefix = f"bench_known_round_{time.time():.0f}"
    try:
        for _ in range(2):
            dhts.append(start_dht(initial_peers))
            averagers.append(
                RoundAverager(
                    [torch.zeros(shape, dtype=dtype) for shape, dtype in tensors],
                    dhts[-1],
                    prefix=prefix,
                    settings=RoundSettings(sender_timeout_s=5.0),
                )
            )
        members = [a.member_id for a in averagers]
        values = [[torch.randn(shape, dtype=dtype) for shape, dtype in tensors] for _ in averagers]
        times: list[float] = []
        failed = 0
        for attempt in range(rounds + 1):
            round_id = f"bench-{attempt}".encode()
            took = _released_together(
                [
                    lambda a=a, v=v: a.average(v, round_id=round_id, members=members, timeout_s=timeout_s).complete
                    for a, v in zip(averagers, values)
                ],
                join_s=timeout_s + 20,
            )
            if attempt == 0:
                continue
            if None in took:
                failed += 1
            else:
                times += took
        if not times:
            raise RuntimeError(f"known-group rounds completed none of {rounds}; see the log for why")
        return times, failed
    finally:
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in dhts:
            stop_dht(dht)


def _both_step(averagers, find_s: float, averaging_timeout_s: float) -> list[float | None]:
    """One round: both averagers' step() released at once; each one's seconds, None where it failed."""
    return _released_together(
        [lambda a=a: a.step(timeout=find_s, wait=True) is not None for a in averagers], join_s=averaging_timeout_s + 10
    )


def _released_together(calls: list[Callable[[], bool]], *, join_s: float) -> list[float | None]:
    """Run `calls` from a thread each, released at once: each one's seconds, None where it returned False or raised."""
    barrier, took = threading.Barrier(len(calls)), [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        began = time.perf_counter()
        try:
            if calls[i]():
                took[i] = time.perf_counter() - began
        except Exception as exc:  # no group found, or the round failed: a failed round
            logger.warning("an all-reduce round failed: %r", exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_s)
    return took


# --- reading logs (pure) ---


def read_steps(path: Path) -> list[dict]:
    """The per-step records of a `swarmlm train --log-json` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def allreduce_rounds_s(log_text: str, *, min_members: int = 2) -> list[float]:
    """Seconds of each successful stage round ("... among N members in Xs") with N >= min_members."""
    return [float(m.group(2)) for m in _ROUND.finditer(log_text) if int(m.group(1)) >= min_members]


def allreduce_bytes(log_text: str) -> int:
    """Bytes a member's rounds sent ("..., N bytes sent"), all rounds together."""
    return sum(int(m.group(3) or 0) for m in _ROUND.finditer(log_text))


def updates_applied(log_text: str, run_id: str) -> int:
    """The last update a peer's log says it applied in run `run_id` (0 if none)."""
    # the update a round averaged is applied right after it: its count is the last one's number plus one
    return max((int(m.group(1)) + 1 for m in _UPDATE.finditer(log_text) if m.group(2) == run_id), default=0)


def final_loss(losses: list[float], last: int = 5) -> float:
    """Mean loss of the last `last` steps (all of them when there are fewer)."""
    if not losses:
        raise ValueError("no steps to average: the run logged no loss")
    return statistics.fmean(losses[-last:])


def mean_curve(curves: list[list[float]]) -> list[float]:
    """Per-step mean of several runs' losses (as long as the shortest run)."""
    return [statistics.fmean(values) for values in zip(*curves)]


def step_seconds(steps: list[dict], seq_len: int) -> list[float]:
    """Wall time of each step, from its samples and tokens/s."""
    return [s["samples"] * seq_len / s["tokens_per_s"] for s in steps if s["tokens_per_s"] > 0]


def tokens_per_second(steps: list[dict], seq_len: int) -> float:
    """A trainer's tokens/s over `steps`: their tokens over their summed seconds (a sync's slow step counts for its
    time, where a mean of the steps' rates would not weigh it)."""
    return sum(s["samples"] * seq_len for s in steps) / sum(step_seconds(steps, seq_len))


def steady_rates(steps: list[dict], skip: int = 2) -> list[float]:
    """tokens/s of each step after the first `skip` (warm-up: connections, first allocations)."""
    rates = [s["tokens_per_s"] for s in steps]
    return rates[skip:] if len(rates) > skip else rates


def summed_rates(runs: list[list[dict]], skip: int = 2) -> list[float]:
    """Per-step tokens/s of trainers running at once, added up step by step (after `skip` steps)."""
    return [sum(values) for values in zip(*(steady_rates(steps, skip) for steps in runs))]
