"""Runs a Plan: per model, the wire and offload scenarios, then each split of its blocks with the model scenarios;
then, once, moe (a model of its own, in this process) and train_swarm, which starts a swarm of its own.

Each scenario runs under `_Collector.attempt`: a failure is logged with its traceback and recorded, and the run goes
on with the next one (peers and clients are still stopped by the harness's context managers).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import models
from bench.harness import ModelRun
from bench.load import OutsideLoad
from bench.plan import DELAYED_SCENARIOS, Plan
from bench.scenarios import (
    api,
    concurrency,
    decode,
    moe,
    offload,
    prefill,
    speculative,
    startup,
    train,
    train_swarm,
    wan,
    wire,
)
from bench.stats import Row
from bench.train_runs import TRAIN_MODEL
from swarm.progress import progress

logger = logging.getLogger(__name__)


class _Collector:
    def __init__(self):
        self.rows: list[Row] = []
        self.errors: list[str] = []
        # on a terminal: which scenario runs, how many are done and how long it all took so far
        self.bar = progress(total=None, desc="bench", unit="scenario")

    def attempt(self, what: str, fn: Callable[[], list[Row] | None]) -> None:
        logger.info("running %s", what)
        self.bar.set_description_str(what)
        began = time.monotonic()
        try:
            with OutsideLoad() as load:
                found = fn() or []
        except Exception as exc:
            logger.error("%s failed:\n%s", what, traceback.format_exc())
            self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return
        finally:
            self.bar.update(1)
        logger.info(
            "%s done in %.1fs (other processes kept %.2f cores busy)", what, time.monotonic() - began, load.cores or 0.0
        )
        for row in found:
            row.extra.setdefault("outside_load_cores", load.cores)
        self.rows += found


def _wire(plan: Plan, model: models.BenchModel) -> list[Row]:
    results = wire.measure(
        model.config.hidden_size,
        plan.dtype,
        train_batch=plan.train_batch,
        train_seq=plan.train_seq,
        calls=plan.wire_calls,
        repeats=plan.repeats,
        threads=plan.peer_threads,
        omp_passive=plan.peer_omp_passive,
    )
    return wire.rows_from(model.name, model.config.hidden_size, plan.dtype, results)


def _model_scenarios(plan: Plan, model: models.BenchModel, log_dir: Path, out: _Collector) -> None:
    wanted = set(plan.scenarios)
    probe: dict = {}
    if "startup" in wanted:
        out.attempt(f"{model.name}/memory probe", lambda: probe.update(startup.whole_model_probe(model, plan)))
    largest = max(plan.peer_counts)
    # decode runs on every split; the other scenarios on the largest one (3 peers by default), and concurrency
    # also on one peer serving every block
    one_peer = "concurrency" in wanted and plan.concurrency_one_peer and largest > 1
    counts = sorted((set(plan.peer_counts) if "decode" in wanted else {largest}) | ({1} if one_peer else set()))
    counts.reverse()
    if not wanted & {"decode", "prefill", "train", "concurrency", "api", "startup"}:
        counts = []  # only the scenarios behind proxies: they start a split of their own
    with ModelRun(model, plan, log_dir) as model_run:
        for count in counts:
            name = f"{model.name}/{count} peers"
            full = count == largest
            try:
                with model_run.split(count) as split:
                    if "decode" in wanted and count in plan.peer_counts:
                        out.attempt(f"{name}/decode", lambda: decode.run(model_run, split))
                        model_run.note_memory(split, "after decode")
                    for scenario, module in (
                        ("prefill", prefill),
                        ("train", train),
                        ("concurrency", concurrency),
                        ("api", api),
                    ):
                        if scenario in wanted and (full or (scenario == "concurrency" and count == 1 and one_peer)):
                            out.attempt(f"{name}/{scenario}", lambda: module.run(model_run, split))
                            model_run.note_memory(split, f"after {scenario}")
            except Exception as exc:
                logger.error("%s: the swarm failed:\n%s", name, traceback.format_exc())
                out.errors.append(f"{name}: {type(exc).__name__}: {exc} (logs in {log_dir})")
                continue
            if "startup" in wanted and full and probe:
                out.attempt(f"{name}/startup", lambda: startup.run(model_run, split, probe))
        if wanted & set(DELAYED_SCENARIOS):
            name = f"{model.name}/{largest} peers behind delaying proxies"
            try:
                with model_run.split(largest, delayed=True) as split:
                    for scenario, module in (("wan", wan), ("speculative", speculative)):
                        if scenario in wanted:
                            out.attempt(f"{name}/{scenario}", lambda: module.run(model_run, split))
            except Exception as exc:
                logger.error("%s: the swarm failed:\n%s", name, traceback.format_exc())
                out.errors.append(f"{name}: {type(exc).__name__}: {exc} (logs in {log_dir})")


def _train_swarm(
    plan: Plan, *, models_dir: Path, cache_dir: Path, out_dir: Path, out: _Collector, descriptions: dict
) -> None:
    """Each part of train_swarm under `attempt`, so that one failing part does not hide the others."""
    try:
        with train_swarm.TrainSwarm(plan, models_dir=models_dir, cache_dir=cache_dir, out_dir=out_dir) as bench:
            descriptions[TRAIN_MODEL] = bench.description
            for part, fn in bench.parts():
                out.attempt(f"train_swarm/{part}", fn)
    except Exception as exc:  # its model could not be built, or its bootstrap node did not start
        logger.error("train_swarm: %s", traceback.format_exc())
        out.errors.append(f"train_swarm: {type(exc).__name__}: {exc}")


def run_models(plan: Plan, *, models_dir: Path, cache_dir: Path, out_dir: Path) -> tuple[list[Row], list[str], dict]:
    """Every scenario of `plan` over every model; returns rows, errors and the models' descriptions.

    Interrupted (KeyboardInterrupt), it returns what was measured so far, with the interruption among the errors.
    """
    out = _Collector()
    try:
        descriptions = {}
        per_model = plan.needs_swarm or {"wire", "offload"} & set(plan.scenarios)
        for name in plan.configs if per_model else ():
            try:
                model = models.resolve(
                    name, models_dir=models_dir, cache_dir=cache_dir, dtype=plan.dtype, device=plan.device
                )
            except Exception as exc:
                logger.error("model %s unavailable:\n%s", name, traceback.format_exc())
                out.errors.append(f"{name}: model unavailable: {type(exc).__name__}: {exc}")
                continue
            descriptions[name] = model.description
            if "wire" in plan.scenarios:
                out.attempt(f"{name}/wire", lambda: _wire(plan, model))
            if "offload" in plan.scenarios:
                out.attempt(f"{name}/offload", lambda: offload.run(plan, model, cache_dir))
            if plan.needs_swarm:
                try:
                    _model_scenarios(plan, model, out_dir / "logs" / name, out)
                except Exception as exc:  # the bootstrap node failed to start, say
                    logger.error("%s: %s", name, traceback.format_exc())
                    out.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        if "moe" in plan.scenarios:
            descriptions[moe.CONFIG] = moe.DESCRIPTION
            out.attempt("moe", lambda: moe.run(plan, cache_dir))
        if "train_swarm" in plan.scenarios:
            _train_swarm(
                plan, models_dir=models_dir, cache_dir=cache_dir, out_dir=out_dir, out=out, descriptions=descriptions
            )
    except KeyboardInterrupt:  # Ctrl+C or SIGTERM: the harness stopped the peers on the way out; keep what was measured
        logger.warning("interrupted: reporting the %d results measured so far", len(out.rows))
        out.errors.append(f"interrupted after {len(out.rows)} results: the scenarios after them did not run")
    finally:
        out.bar.close()
    return out.rows, out.errors, descriptions
