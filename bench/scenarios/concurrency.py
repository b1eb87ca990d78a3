"""Concurrency: N clients generating greedily at the same time against the same peers.

Each client is a thread running its own generation the way `swarmlm api` runs a request (client/decoding.py):
its own inference session (its own KV caches on every peer), its steps on the client library's event loop, the
sessions sharing one gRPC channel per peer, and the LM heads of clients whose steps come back together computed
as one batch (client/heads.py). Peers batch the decode steps that reach them together (peer/batching.py).
Reported: aggregate decode tokens/s and per-token latency (p50, p95), each vs one client alone, and the aggregate
vs the local Hugging Face model generating the same prompts as one batch in this process.

It runs against the largest split (3 peers) and, outside --quick, against one peer serving every block too: on a
machine of few cores, 3 peers and the client contend for the cores, and one peer measures batching itself.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import torch
from transformers import DynamicCache

from bench.harness import ModelRun, Split, peer_infos, sync_for
from bench.scenarios.decode import prompt_ids
from bench.stats import Row, Summary, Target, percentile
from client.decoding import decode_tokens, lm_head_batcher

logger = logging.getLogger(__name__)

# of 8 clients on the default model over 3 peers (issue 11)
TARGETS = {
    "aggregate": Target("ratio", ">=", 4.0, ">= 4x 1 client"),
    "p95": Target("ratio", "<=", 2.5, "<= 2.5x 1 client"),
    "local": Target("ratio", ">=", 0.6, ">= 0.6x local batch 8"),
}
# of 8 clients on the default model, one peer serving every block: batching itself (issue 26)
ONE_PEER_TARGETS = {**TARGETS, "local": Target("ratio", ">=", 0.7, ">= 0.7x local batch 8")}


def _greedy(ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def _one_client(client, heads, prompt: torch.Tensor, steps: int) -> tuple[float, float, list[float]]:
    """(decode start, decode end, step latencies) of one greedy generation: `steps` tokens after the first."""
    times = [time.perf_counter() for _ in decode_tokens(client, heads, prompt[0].tolist(), steps + 1, _greedy)]
    return times[0], times[-1], [b - a for a, b in itertools.pairwise(times)]


def _clients(client, heads, prompts: list[torch.Tensor], steps: int):
    """Every client in a thread of its own, all at once, as `swarmlm api` runs concurrent requests."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = _one_client(client, heads, prompts[i], steps)
        except BaseException as exc:  # raised below, in the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"bench-client-{i}") for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _local_batch(model, prompts: torch.Tensor, steps: int, device: str) -> float:
    """Aggregate decode tokens/s of the local model generating greedily for the whole batch `prompts` at once."""
    sync = sync_for(device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(prompts.to(device), cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync()
        began = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        sync()
    return prompts.shape[0] * steps / (time.perf_counter() - began)


async def _batch_counters(client) -> tuple[int, int]:
    """(batched forwards, decode steps in them) summed over the online peers of the client's model."""
    infos = (await peer_infos(client)).values()
    return sum(i.decode_batches for i in infos), sum(i.batched_steps for i in infos)


def _targets(model_name: str, split: Split, n: int) -> dict[str, Target | None]:
    targets = {3: TARGETS, 1: ONE_PEER_TARGETS}.get(split.count) if model_name == "default" and n == 8 else None
    return {name: targets[name] if targets else None for name in TARGETS}


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model, client = model_run.plan, model_run.model, split.client
    steps = plan.concurrency_steps
    prompts = [
        prompt_ids(model.config.vocab_size, plan.decode_prompt, seed=100 + i)
        for i in range(max(plan.concurrency_clients))
    ]
    heads = lm_head_batcher(client)
    _clients(client, heads, prompts[:1], min(4, steps))  # warm-up
    measured: dict[int, tuple[list[float], list[float], list[float]]] = {}
    local: dict[int, list[float]] = {}
    mean_batch: dict[int, float] = {}  # decode steps per batched forward on the peers
    mean_heads: dict[int, float] = {}  # rows per batch of the client's LM head
    for n in plan.concurrency_clients:
        aggregate, latencies, p95s = [], [], []
        counted = client._run(_batch_counters(client))
        heads_counted = heads.rounds, heads.rows
        _local_batch(model_run.reference, torch.cat(prompts[:n]), min(4, steps), plan.device)  # warm-up
        local[n] = []
        for _ in range(plan.repeats):
            results = _clients(client, heads, prompts[:n], steps)
            wall = max(end for _, end, _ in results) - min(start for start, _, _ in results)
            aggregate.append(n * steps / wall)
            run_latencies = [lat for _, _, lats in results for lat in lats]
            latencies += run_latencies
            p95s.append(percentile(run_latencies, 95))
            local[n].append(_local_batch(model_run.reference, torch.cat(prompts[:n]), steps, plan.device))
        batches, steps_batched = (b - a for a, b in zip(counted, client._run(_batch_counters(client))))
        mean_batch[n] = steps_batched / batches if batches else 1.0
        rounds, rows = heads.rounds - heads_counted[0], heads.rows - heads_counted[1]
        mean_heads[n] = rows / rounds if rounds else 1.0
        logger.info(
            "%d clients: %.2f decode steps per batched forward on the peers, %.2f rows per LM head batch",
            n,
            mean_batch[n],
            mean_heads[n],
        )
        measured[n] = (aggregate, latencies, p95s)
    base = min(measured)
    rows = []
    for n, (aggregate, latencies, p95s) in measured.items():
        variant = f"{split.count} peer{'s' * (split.count > 1)}, {n} client{'s' * (n > 1)}"
        targets = _targets(model.name, split, n)
        common = dict(scenario="concurrency", config=model.name, variant=variant, reference_name=f"{base} client")
        rows.append(
            Row(
                metric="aggregate decode",
                unit="tokens/s",
                ours=Summary.of(aggregate),
                reference=Summary.of(measured[base][0]),
                extra={
                    "steps_per_client": steps,
                    "mean_peer_batch": round(mean_batch[n], 2),
                    "mean_head_batch": round(mean_heads[n], 2),
                },
                target=targets["aggregate"],
                **common,
            )
        )
        rows.append(
            Row(
                metric="per-token latency p50",
                unit="ms",
                ours=Summary.of(latencies).scaled(1e3),
                reference=Summary.of(measured[base][1]).scaled(1e3),
                **common,
            )
        )
        rows.append(
            Row(
                metric="per-token latency p95",
                unit="ms",
                ours=Summary.of(p95s).scaled(1e3),
                reference=Summary.of(measured[base][2]).scaled(1e3),
                target=targets["p95"],
                **common,
            )
        )
        common["reference_name"] = f"local HF model, batch {n}"
        rows.append(
            Row(
                metric="aggregate decode vs local batch",
                unit="tokens/s",
                ours=Summary.of(aggregate),
                reference=Summary.of(local[n]),
                target=targets["local"],
                **common,
            )
        )
    return rows
