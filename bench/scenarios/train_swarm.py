"""train_swarm: training with real peers and `swarmlm train` processes, against `swarmlm train --local`.

Runs once per benchmark run, with a swarm of its own (one bootstrap node, fresh peers per part, each part with its
own --dht-prefix and --run-id) and a small random Llama with the default model's tokenizer (bench/train_runs.py),
trained on the bundled Shakespeare plays. Its parts run one after the other, each under the runner's `attempt`:

    1 trainer    2 training peers (0:2, 2:4) + one trainer vs --local on the same batches: final loss, tokens/s,
                 samples/s per stage
    2 trainers   2 peers per stage + two trainers (seeds 0, 1) vs --local with their joint batch of 16
    wire dtype   the 1-trainer run again with activations and gradients sent as bfloat16, then as blockwise int8
                 (`--wire-dtype`): final loss against --local (the loss effect of the compression)
    averaging    seconds per group all-reduce in those peers' logs vs two bare hivemind averagers of a stage's size
    compression  the 2-trainer run again with --averaging-compression float16, then int8: final loss against the
                 float64 run (same batches), and the bytes the rounds sent per trained sample
    local steps  the 2-trainer run again with --local-steps 4 (DiLoCo: inner AdamW steps on each member's own
                 gradients, a sync of the weights' change every 4 updates): final loss and round bytes per sample
                 against the synchronous float64 run
    pipelining   2 peers behind 20 ms one-way delay proxies: --max-in-flight 4 vs 1, tokens/s
    default      (full preset) tokens/s of the default model, seq 128, batch 4, vs --local

The loss curves travel in the final-loss rows' `extra["curves"]`; bench/report.py draws train_swarm.png from them.

It does not measure convergence beyond a few dozen steps, GPUs for the trainer (it computes on the CPU), or LoRA.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from bench import train_runs as tr
from bench.plan import Plan
from bench.proxy import DelayProxy, netem_available
from bench.stats import Band, Row, Summary, Target
from client.demo.local_swarm import LocalSwarm
from swarm.models.checkpoint import load_config
from swarm.models.default_model import resolve_default_model

logger = logging.getLogger(__name__)


FIDELITY_TARGET = Band("ratio", "<=", 1.02, "0.98-1.02x local", low=0.98)
THROUGHPUT_TARGET = Target("ratio", ">=", 0.7, ">= 0.7x local")
AVERAGING_TARGET = Target("ratio", "<=", 1.2, "<= 1.2x bare averager")
PIPELINING_TARGET = Target("ratio", ">=", 2.0, ">= 2x one in flight")
LOCAL_STEPS_TARGET = Target("ratio", "<=", 1.02, "<= 1.02x a round every update")
DELAY_S = 0.02
SPANS = [(0, 2), (2, 4)]
DEFAULT_SPANS = [(0, 15), (15, 30)]
SKIP = 2  # warm-up steps left out of tokens/s
LOCAL = "swarmlm train --local"

NOTES = {
    "exact": "same batches as the local run (seed 0): the swarm computes what one process would, to float32 rounding",
    "seeds": "trainer seeds 0 and 1 draw other batches than the local batch of 16 (seed 0): the curves agree in "
    "distribution, not step for step; the swarm's loss is the mean of both trainers'",
    "wire": "same batches as the local run (seed 0); hidden states and gradients travel compressed both ways "
    "(bfloat16: 2 bytes a value; int8: 1 byte plus 4 per block of 64), so the swarm's loss differs from the local "
    "run's by the compression's effect only",
    "compression": "the 2-trainer run (same seeds, so the same batches) with --averaging-compression float16 "
    "(parts scaled per part) or int8 (blocks of 64 values with a scale each, error feedback): every round of the "
    "stages and of the trainers sends them so; the loss differs from the float64 run's by the compression's effect "
    "only (the members of a group still end identical)",
    "local": "the 2-trainer run (same seeds, so the same batches) with --local-steps 4 and DiLoCo's outer step (lr "
    "0.7, Nesterov momentum 0.9): between syncs every member of a stage and every trainer steps on its own micro-batches "
    "alone; the loss differs from the synchronous run's by the algorithm, not by rounding",
    "bytes": "bytes of the parts every peer and trainer sent to the others' reducers in their rounds (their answers, "
    "as large, come on top), over the samples the trainers trained",
    "rates": f"tokens/s: median of the per-step figures of --log-json after the first {SKIP} steps; a swarm step "
    "includes waiting for the stages' updates; trainer, peers and the local run share this machine's cores",
    "stage": "samples/s of a stage: the updates its peer logged x its target batch / the trainer's summed step "
    "times (the peer's log stamps whole seconds); reference: the local run's samples / its summed step times",
    "known": "known-group round: two RoundAveragers (swarm/training/rounds.py, what a stage's group runs) in the bench "
    "process, each on a DHT node joined to the same bootstrap, released at once from two threads like the bare "
    "averagers, timed by average(): the mechanisms compared alone, without the peers' other work",
    "rounds": "all-reduce: each peer's '... among 2 members in X s', from entering its round (on the trainer's "
    "commit: no matchmaking, so no step waits on it) to the result; both stages average at about the same time. "
    "Bare: two DecentralizedAveragers in the bench process, each on a plain hivemind DHT node of its own "
    "(ours refuse hivemind's matchmaking records), "
    "the tensors a stage's round carries (its gradients in float64), target_group_size 2 (a group starts once "
    "both joined), request_timeout 0.5, both released at once from two threads; timed by step(), whose "
    "matchmaking is counted",
}


class TrainSwarm:
    """`with TrainSwarm(plan, ...) as bench:` then run each of `bench.parts()`; leaving stops every process."""

    def __init__(self, plan: Plan, *, models_dir: Path, cache_dir: Path, out_dir: Path):
        self.plan, self.models_dir, self.cache_dir, self.out_dir = plan, models_dir, cache_dir, out_dir
        self.small = tr.TrainSettings(seq_len=64, batch_size=8, micro_batch_size=2, steps=plan.train_swarm_steps)
        self.rounds_s: list[float] = []
        self.one_local: list[dict] | None = None  # the 1-trainer part's --local run, which `wire_dtypes` reuses
        self.two_swarm: tuple[list[float], float] | None = None  # the 2-trainer part's loss curve, bytes a sample

    def __enter__(self) -> TrainSwarm:
        self.model = tr.build_train_model(self.models_dir, self.cache_dir)
        self.config = load_config(self.model)
        self.swarm = LocalSwarm(self.out_dir / "logs" / "train_swarm")
        try:
            self.swarm.start_bootstrap()
        except BaseException:
            self.swarm.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.swarm.stop()

    @property
    def description(self) -> str:
        c = self.config
        return (
            f"random llama, hidden {c.hidden_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} heads, "
            f"vocab {c.vocab_size} (the default model's tokenizer), tied embeddings"
        )

    def parts(self) -> list[tuple[str, Callable[[], list[Row]]]]:
        parts = [
            ("1 trainer", self.one_trainer),
            ("2 trainers", self.two_trainers),
            ("wire dtype", self.wire_dtypes),
            ("averaging", self.averaging),
            ("compression", self.compression),
            ("local steps", self.local_steps),
            ("pipelining", self.pipelining),
        ]
        if not self.plan.quick:
            parts.append(("default model", self.default_model))
        return parts

    # --- processes ---

    def _timeout_s(self, settings: tr.TrainSettings) -> float:
        return 180.0 + 30.0 * settings.steps  # a step of two trainers takes ~15 s on 2 idle cores

    def _train(self, runs: dict[str, list[str]], settings: tr.TrainSettings) -> dict[str, list[dict]]:
        return tr.run_trainers(self.swarm, runs, timeout_s=self._timeout_s(settings))

    def _remote(self, model: Path, prefix: str, run_id: str) -> list[str]:
        return [str(model), "--initial-peers", *self.swarm.initial_peers, "--dht-prefix", prefix, "--run-id", run_id]

    @contextlib.contextmanager
    def _peers(
        self,
        model: Path,
        prefix: str,
        run_id: str,
        spans: list[tuple[int, int]],
        target: int,
        settings: tr.TrainSettings,
        ports: list[tuple[int, str]] | None = None,
        extra: tuple[str, ...] = (),
    ) -> Iterator[list[str]]:
        names: list[str] = []
        try:
            names += tr.start_training_peers(
                self.swarm,
                model,
                load_config(model).num_hidden_layers,
                prefix=prefix,
                run_id=run_id,
                spans=spans,
                target_batch=target,
                settings=settings,
                threads=self.plan.peer_threads,
                device=self.plan.device,
                ports=ports,
                extra=extra,
            )
            yield names
        finally:
            tr.stop_peers(self.swarm, names or [tr.peer_name(prefix, i) for i in range(len(spans))])

    # --- parts ---

    def one_trainer(self) -> list[Row]:
        s, prefix = self.small, "bench-train-one"
        local = self._train({"one-local": [str(self.model), "--local", "--run-id", "one", *s.args()]}, s)["one-local"]
        self.one_local = local
        with self._peers(self.model, prefix, "one", SPANS, s.batch_size, s) as names:
            ours = self._train({"one-swarm": [*self._remote(self.model, prefix, "one"), *s.args()]}, s)["one-swarm"]
            updates = [tr.updates_applied(self.swarm.log(name).read_text(), "one") for name in names]
        curves = {
            f"local, batch {s.batch_size}": [r["loss"] for r in local],
            "swarm, 1 trainer": [r["loss"] for r in ours],
        }
        variant = f"1 trainer, 2 peers, batch {s.batch_size}x{s.seq_len}, {len(ours)} steps"
        rows = [
            self._fidelity(variant, [r["loss"] for r in ours], [r["loss"] for r in local], NOTES["exact"], curves),
            self._throughput(self.small, variant, ours, local),
        ]
        seconds = sum(tr.step_seconds(ours, s.seq_len))
        local_rate = sum(r["samples"] for r in local) / sum(tr.step_seconds(local, s.seq_len))
        for (start, end), count in zip(SPANS, updates):
            rows.append(
                Row(
                    "train_swarm",
                    tr.TRAIN_MODEL,
                    variant,
                    f"stage {start}:{end} samples/s",
                    "samples/s",
                    Summary.of([count * s.batch_size / seconds]),
                    Summary.of([local_rate]),
                    LOCAL,
                    extra={"updates": count, "trainer_seconds": seconds, "notes": [NOTES["stage"]]},
                )
            )
        return rows

    def wire_dtypes(self) -> list[Row]:
        s, rows = self.small, []
        local = self.one_local
        if local is None:  # the 1-trainer part failed: its reference is computed here
            local = self._train({"wire-local": [str(self.model), "--local", "--run-id", "w", *s.args()]}, s)[
                "wire-local"
            ]
        for wire in ("bfloat16", "int8"):
            prefix, run_id = f"bench-train-wire-{wire}", f"wire-{wire}"
            with self._peers(self.model, prefix, run_id, SPANS, s.batch_size, s):
                name = f"wire-{wire}"
                ours = self._train(
                    {name: [*self._remote(self.model, prefix, run_id), *s.args(), "--wire-dtype", wire]}, s
                )[name]
            curves = {
                f"local, batch {s.batch_size}": [r["loss"] for r in local],
                f"swarm, {wire} wire": [r["loss"] for r in ours],
            }
            variant = f"1 trainer, 2 peers, --wire-dtype {wire}, batch {s.batch_size}x{s.seq_len}, {len(ours)} steps"
            rows.append(
                self._fidelity(variant, [r["loss"] for r in ours], [r["loss"] for r in local], NOTES["wire"], curves)
            )
        return rows

    def _two_trainers_run(self, name: str, extra: tuple[str, ...] = ()) -> tuple[dict, list[str]]:
        """Two trainers (seeds 0, 1) on 2 peers per stage: (their --log-json steps by run name, the peers' names)."""
        s, joint = self.small, 2 * self.small.batch_size
        prefix = f"bench-train-{name}"
        with self._peers(
            self.model, prefix, name, [SPANS[0], SPANS[0], SPANS[1], SPANS[1]], joint, s, extra=extra
        ) as names:
            runs = self._train(
                {
                    f"{name}-swarm-seed{seed}": [*self._remote(self.model, prefix, name), *s.args(seed=seed), *extra]
                    for seed in (0, 1)
                },
                s,
            )
        return runs, names

    def _round_bytes_per_sample(self, runs: dict, names: list[str]) -> float:
        """Bytes every peer's and trainer's rounds sent, per sample the trainers trained."""
        sent = sum(tr.allreduce_bytes(self.swarm.log(name).read_text()) for name in [*names, *runs])
        return sent / sum(r["samples"] for steps in runs.values() for r in steps)

    def two_trainers(self) -> list[Row]:
        s, joint = self.small, 2 * self.small.batch_size
        local = self._train(
            {"two-local": [str(self.model), "--local", "--run-id", "two", *s.args(batch_size=joint)]}, s
        )["two-local"]
        runs, names = self._two_trainers_run("two")
        self.rounds_s = [t for name in names for t in tr.allreduce_rounds_s(self.swarm.log(name).read_text())]
        trainer_rounds = [t for name in runs for t in tr.allreduce_rounds_s(self.swarm.log(name).read_text())]
        trainers = [[r["loss"] for r in steps] for steps in runs.values()]
        ours = tr.mean_curve(trainers)
        self.two_swarm = (ours, self._round_bytes_per_sample(runs, names))
        curves = {
            f"local, batch {joint}": [r["loss"] for r in local],
            "swarm, mean of 2 trainers": ours,
            **{f"trainer seed {i}": curve for i, curve in enumerate(trainers)},
        }
        variant = f"2 trainers x batch {s.batch_size}, 2 peers per stage, vs local batch {joint}, {len(ours)} steps"
        rates = tr.summed_rates(list(runs.values()), SKIP)
        return [
            self._fidelity(variant, ours, [r["loss"] for r in local], NOTES["seeds"], curves),
            Row(
                "train_swarm",
                tr.TRAIN_MODEL,
                variant,
                "training throughput, both trainers",
                "tokens/s",
                Summary.of(rates),
                Summary.of(tr.steady_rates(local, SKIP)),
                LOCAL,
                extra={
                    "trainer_rounds_s": trainer_rounds,
                    "notes": [NOTES["rates"], _two_note(trainer_rounds, self.rounds_s)],
                },
            ),
        ]

    def compression(self) -> list[Row]:
        if self.two_swarm is None:
            raise RuntimeError("the 2-trainer part failed: there is no float64 run to compare with")
        plain, plain_bytes = self.two_swarm
        rows, curves = [], {"swarm, float64 rounds": plain}
        for codec in ("float16", "int8"):
            runs, names = self._two_trainers_run(codec, ("--averaging-compression", codec))
            ours = tr.mean_curve([[r["loss"] for r in steps] for steps in runs.values()])
            variant = (
                f"2 trainers x batch {self.small.batch_size}, 2 peers per stage, {len(ours)} steps, {codec} rounds"
            )
            curves[f"swarm, {codec} rounds"] = ours
            fidelity = self._fidelity(variant, ours, plain, NOTES["compression"], dict(curves))
            fidelity.reference_name = "the same run, float64 rounds"
            rows += [
                fidelity,
                Row(
                    "train_swarm",
                    tr.TRAIN_MODEL,
                    variant,
                    "round bytes sent per sample",
                    "bytes",
                    Summary.of([self._round_bytes_per_sample(runs, names)]),
                    Summary.of([plain_bytes]),
                    "the same run, float64 rounds",
                    extra={"notes": [NOTES["bytes"]]},
                ),
            ]
        return rows

    def local_steps(self) -> list[Row]:
        if self.two_swarm is None:
            raise RuntimeError("the 2-trainer part failed: there is no synchronous run to compare with")
        plain, plain_bytes = self.two_swarm
        runs, names = self._two_trainers_run("local4", ("--local-steps", "4"))
        ours = tr.mean_curve([[r["loss"] for r in steps] for steps in runs.values()])
        variant = f"2 trainers x batch {self.small.batch_size}, 2 peers per stage, {len(ours)} steps, --local-steps 4"
        curves = {"swarm, a round every update": plain, "swarm, --local-steps 4": ours}
        fidelity = self._fidelity(variant, ours, plain, NOTES["local"], curves)
        fidelity.reference_name = "the same run, a round every update"
        fidelity.target = LOCAL_STEPS_TARGET  # another algorithm: no worse, not equal
        return [
            fidelity,
            Row(
                "train_swarm",
                tr.TRAIN_MODEL,
                variant,
                "round bytes sent per sample",
                "bytes",
                Summary.of([self._round_bytes_per_sample(runs, names)]),
                Summary.of([plain_bytes]),
                "the same run, a round every update",
                extra={"notes": [NOTES["bytes"]]},
            ),
        ]

    def averaging(self) -> list[Row]:
        if not self.rounds_s:
            raise RuntimeError(
                f"the 2-trainer part logged no all-reduce of 2 members; see its peers' logs in {self.swarm.log_dir}"
            )
        shapes = tr.stage_tensor_shapes(self.model, SPANS[0])
        s = self.small
        # what a stage's round carries (swarm/training/group.py): its gradients, in float64, and nothing else
        tensors = [(shape, torch.float64) for shape in shapes]
        bare, failed = tr.bare_allreduce_s(
            tensors,
            rounds=self.plan.repeats,
            matchmaking_time_s=s.matchmaking_time_s,
            averaging_timeout_s=s.averaging_timeout_s,
        )
        known, known_failed = tr.known_round_s(
            self.swarm.initial_peers, tensors, rounds=self.plan.repeats, timeout_s=s.averaging_timeout_s
        )
        numel = sum(math.prod(shape) for shape in shapes)
        return [
            Row(
                "train_swarm",
                tr.TRAIN_MODEL,
                f"2 peers per stage, {numel / 1e6:.1f}M floats a round",
                "group all-reduce",
                "s",
                Summary.of(self.rounds_s),
                Summary.of(bare),
                "bare hivemind DecentralizedAverager",
                AVERAGING_TARGET,
                extra={
                    "rounds_s": self.rounds_s,
                    "bare_s": bare,
                    "bare_failed_rounds": failed,
                    "notes": [NOTES["rounds"]],
                },
            ),
            Row(
                "train_swarm",
                tr.TRAIN_MODEL,
                f"2 averagers in one process, {numel / 1e6:.1f}M floats a round",
                "known-group round",
                "s",
                Summary.of(known),
                Summary.of(bare),
                "bare hivemind DecentralizedAverager",
                AVERAGING_TARGET,
                extra={"known_s": known, "known_failed_rounds": known_failed, "notes": [NOTES["known"]]},
            ),
        ]

    def pipelining(self) -> list[Row]:
        s = tr.TrainSettings(seq_len=64, batch_size=8, micro_batch_size=2, steps=max(4, self.small.steps // 2))
        prefix, in_flight = "bench-train-pipe", s.batch_size // s.micro_batch_size
        with contextlib.ExitStack() as stack:
            ports = []
            for _ in SPANS:
                port = tr.free_port()
                ports.append((port, stack.enter_context(DelayProxy(f"127.0.0.1:{port}", DELAY_S)).endpoint))
            with self._peers(self.model, prefix, "pipe", SPANS, s.batch_size, s, ports=ports):
                runs = {
                    k: self._train(
                        {f"pipe-{k}-in-flight": [*self._remote(self.model, prefix, "pipe"), *s.args(max_in_flight=k)]},
                        s,
                    )[f"pipe-{k}-in-flight"]
                    for k in (in_flight, 1)
                }
        slow = statistics.median(tr.step_seconds(runs[1], s.seq_len)[SKIP:] or [math.nan])
        hidden = in_flight * 2 * len(SPANS) * 2 * DELAY_S  # micro-batches x forward+backward x stages x round trip
        ceiling = (
            f"with 1 in flight a step took {slow:.2f} s, of which the delay is at most {hidden:.2f} s "
            f"({in_flight} micro-batches x forward+backward x {len(SPANS)} stages x {2 * DELAY_S * 1000:.0f} ms "
            f"round trip): hiding it all gives about {slow / max(slow - hidden, 1e-9):.2f}x; beyond that only "
            f"trainer and peers computing at once on the shared cores helps, and compute dominates here"
        )
        how = (
            "tc netem is available here but not used: it would delay the whole loopback"
            if netem_available()
            else "tc netem is not available here"
        )
        return [
            Row(
                "train_swarm",
                tr.TRAIN_MODEL,
                f"2 peers, {DELAY_S * 1000:.0f} ms one-way each, {in_flight} vs 1 micro-batches in flight",
                "training throughput",
                "tokens/s",
                Summary.of(tr.steady_rates(runs[in_flight], SKIP)),
                Summary.of(tr.steady_rates(runs[1], SKIP)),
                "--max-in-flight 1",
                PIPELINING_TARGET,
                extra={
                    "notes": [
                        f"delay: bench/proxy.py DelayProxy in front of each peer's gRPC port, which the "
                        f"peer announces ({how}); DHT traffic is not delayed",
                        ceiling,
                        NOTES["rates"],
                    ]
                },
            )
        ]

    def default_model(self) -> list[Row]:
        model = resolve_default_model(self.cache_dir)
        s, prefix = tr.TrainSettings(seq_len=128, batch_size=4, micro_batch_size=2, steps=4), "bench-train-default"
        local = self._train({"default-local": [str(model), "--local", "--run-id", "dflt", *s.args()]}, s)
        with self._peers(model, prefix, "dflt", DEFAULT_SPANS, s.batch_size, s):
            ours = self._train({"default-swarm": [*self._remote(model, prefix, "dflt"), *s.args()]}, s)
        variant = f"1 trainer, 2 peers (0:15, 15:30), batch {s.batch_size}x{s.seq_len}, {s.steps} steps"
        return [self._throughput(s, variant, ours["default-swarm"], local["default-local"], config="default")]

    # --- rows ---

    def _fidelity(
        self, variant: str, ours: list[float], local: list[float], note: str, curves: dict[str, list[float]]
    ) -> Row:
        return Row(
            "train_swarm",
            tr.TRAIN_MODEL,
            variant,
            "final loss, mean of last 5 steps",
            "nats",
            Summary.of([tr.final_loss(ours)]),
            Summary.of([tr.final_loss(local)]),
            LOCAL,
            FIDELITY_TARGET,
            extra={"loss": ours, "local_loss": local, "curves": curves, "notes": [note]},
        )

    def _throughput(
        self, s: tr.TrainSettings, variant: str, ours: list[dict], local: list[dict], *, config: str = tr.TRAIN_MODEL
    ) -> Row:
        return Row(
            "train_swarm",
            config,
            variant,
            "training throughput",
            "tokens/s",
            Summary.of(tr.steady_rates(ours, SKIP)),
            Summary.of(tr.steady_rates(local, SKIP)),
            LOCAL,
            THROUGHPUT_TARGET,
            extra={"seq_len": s.seq_len, "notes": [NOTES["rates"]]},
        )


def _two_note(trainer_rounds: list[float], stage_rounds: list[float]) -> str:
    def median(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} s" if xs else "none logged"

    return (
        f"each step of two trainers averages the gradients of the trainers' embeddings and head (median round "
        f"{median(trainer_rounds)}) after the stages' groups (median round {median(stage_rounds)}), one after the "
        f"other"
    )
