"""Startup and memory: time from launching a peer to ONLINE, and each peer's resident memory.

Peers start one after the other (each timed alone, the earlier ones idle). Memory is the peer process's RSS
when it is ONLINE (its weights are memory-mapped, so mostly not resident yet), after the decode scenario
(every weight used, a KV cache held) and its high-water mark over all scenarios (activations of prefill and
backward included). The comparison is a fresh process holding the whole local model after one short forward.
Target for the RSS after decode: <= the peer's share of the weights + the decode session's KV cache + a fixed
runtime overhead (`Plan.memory_overhead_mib`, stated in the report; a process that only imports the runtime
is measured too).
The peer's DHT helper processes (hivemind's DHT process, p2pd) are listed apart in `extra`.
"""

from __future__ import annotations

from bench import memory
from bench.harness import ModelRun, Split
from bench.models import BenchModel, kv_bytes, span_weight_bytes
from bench.plan import Plan
from bench.stats import Row, Summary, Target

STARTUP_TARGET = Target("value", "<", 10.0, "< 10 s")
MIB = 1024 * 1024


def whole_model_probe(model: BenchModel, plan: Plan) -> dict:
    """Memory of a fresh process holding the whole model, and of one holding only the runtime."""
    return memory.probe(model.path, dtype=plan.dtype, device=plan.device)


def run(model_run: ModelRun, split: Split, probe: dict) -> list[Row]:
    plan, model = model_run.plan, model_run.model
    whole = probe["model"]
    overhead = plan.memory_overhead_mib
    common = dict(scenario="startup", config=model.name, reference_name="process with whole local model")
    rows = []
    for peer in split.peers:
        start, end = peer.span
        blocks = end - start
        variant = f"{split.count} peers, blocks {start}:{end}"
        default_share = model.name == "default" and blocks <= 10
        rows.append(
            Row(
                scenario="startup",
                config=model.name,
                variant=variant,
                metric="launch to ONLINE",
                unit="s",
                ours=Summary.of([peer.startup_s]),
                target=STARTUP_TARGET if default_share else None,
            )
        )
        weights = span_weight_bytes(model_run.reference, start, end) / MIB
        extra = {
            "weights_share_mib": weights,
            "runtime_overhead_allowance_mib": overhead,
            "dht_helper_processes_mib": peer.children_online_mib,
            "whole_model_process": whole,
            "runtime_only_process": probe["runtime_only"],
        }
        if peer.gpu_online_mib is not None:
            extra["gpu_mib"] = peer.gpu_online_mib
        # weights are memory-mapped from the checkpoint: they become resident as they are first used
        rows.append(
            Row(
                metric="peer RSS at ONLINE",
                unit="MiB",
                variant=variant,
                ours=Summary.of([peer.rss_mib["at ONLINE"]]),
                reference=Summary.of([whole["rss_mib"]]),
                extra=extra,
                **common,
            )
        )
        moment = "after decode" if "after decode" in peer.rss_mib else "at the end"
        if moment in peer.rss_mib:
            tokens = plan.decode_prompt + plan.decode_steps + 1 if moment == "after decode" else largest(plan)
            kv = kv_bytes(model.config, blocks, tokens, plan.dtype) / MIB
            budget = weights + kv + overhead
            rss = peer.rss_mib[moment]
            rows.append(
                Row(
                    metric=f"peer RSS {moment}",
                    unit="MiB",
                    variant=variant,
                    ours=Summary.of([rss]),
                    reference=Summary.of([whole["rss_mib"]]),
                    extra={**extra, "kv_cache_allowance_mib": kv, "overhead_mib": rss - weights - kv},
                    target=Target(
                        "value", "<=", budget, f"<= {budget:.0f} (share {weights:.0f} + KV {kv:.0f} + {overhead:.0f})"
                    ),
                    **common,
                )
            )
        if peer.peak_rss_mib is not None:
            rows.append(
                Row(
                    metric="peer peak RSS",
                    unit="MiB",
                    variant=variant,
                    ours=Summary.of([peer.peak_rss_mib]),
                    reference=Summary.of([whole["peak_rss_mib"] or whole["rss_mib"]]),
                    extra={
                        "note": "high-water mark over every scenario: activations of prefill and backward included",
                        "rss_mib": peer.rss_mib,
                        "high_water_mark_after_mib": peer.peak_by_moment_mib,
                    },
                    **common,
                )
            )
    return rows


def largest(plan: Plan) -> int:
    """The most KV-cache tokens any scenario held on one peer at once."""
    longest = max(max(plan.prefill_lengths), plan.decode_prompt + plan.decode_steps + 1)
    if "concurrency" in plan.scenarios:
        longest = max(longest, max(plan.concurrency_clients) * (plan.decode_prompt + plan.concurrency_steps + 1))
    return longest
