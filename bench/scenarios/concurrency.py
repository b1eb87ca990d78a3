"""Concurrency: N clients generating greedily at the same time against the same peers.

Each client is its own inference session (its own KV caches on every peer) driven on the client library's
event loop, the sessions sharing one gRPC channel per peer, as independent users of one gateway would.
Reported: aggregate decode tokens/s and per-client step latency, each vs one client alone: the baseline
that server-side batching will be measured against.
"""

from __future__ import annotations

import asyncio
import time

import torch

from client.session import InferenceSession
from bench.harness import ModelRun, Split
from bench.scenarios.decode import prompt_ids
from bench.stats import Row, Summary


class _Greedy:
    """The local parts of the client model, used between steps (no autograd, never across an await)."""

    def __init__(self, client):
        self.client = client

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.client.get_input_embeddings()(ids)

    def next_token(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.client.lm_head(self.client.model.norm(hidden[:, -1:]))
            return logits.argmax(-1)


async def _one_client(client, prompt: torch.Tensor, steps: int) -> tuple[float, float, list[float]]:
    """(decode start, decode end, step latencies) of one greedy generation."""
    greedy = _Greedy(client)
    session = InferenceSession(client.sequence, prompt.shape[1] + steps + 1, batch_size=1)
    try:
        length = prompt.shape[1]
        out = await session.step(greedy.embed(prompt), None, torch.arange(length).unsqueeze(0))
        token = greedy.next_token(out)
        latencies = []
        began = time.perf_counter()
        for i in range(steps):
            t = time.perf_counter()
            out = await session.step(greedy.embed(token), None, torch.tensor([[length + i]]))
            token = greedy.next_token(out)
            latencies.append(time.perf_counter() - t)
        return began, time.perf_counter(), latencies
    finally:
        await session.close()


async def _clients(client, prompts: list[torch.Tensor], steps: int):
    return await asyncio.gather(*(_one_client(client, prompt, steps) for prompt in prompts))


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model, client = model_run.plan, model_run.model, split.client
    steps = plan.concurrency_steps
    prompts = [prompt_ids(model.config.vocab_size, plan.decode_prompt, seed=100 + i)
               for i in range(max(plan.concurrency_clients))]
    client._run(_clients(client, prompts[:1], min(4, steps)))  # warm-up
    measured: dict[int, tuple[list[float], list[float]]] = {}
    for n in plan.concurrency_clients:
        aggregate, latencies = [], []
        for _ in range(plan.repeats):
            results = client._run(_clients(client, prompts[:n], steps))
            wall = max(end for _, end, _ in results) - min(start for start, _, _ in results)
            aggregate.append(n * steps / wall)
            latencies += [lat for _, _, lats in results for lat in lats]
        measured[n] = (aggregate, latencies)
    base = min(measured)
    rows = []
    for n, (aggregate, latencies) in measured.items():
        variant = f"{split.count} peers, {n} client{'s' * (n > 1)}"
        common = dict(scenario="concurrency", config=model.name, variant=variant, reference_name=f"{base} client")
        rows.append(Row(metric="aggregate decode", unit="tokens/s", ours=Summary.of(aggregate),
                        reference=Summary.of(measured[base][0]), extra={"steps_per_client": steps}, **common))
        rows.append(Row(metric="per-client step", unit="ms", ours=Summary.of(latencies).scaled(1e3),
                        reference=Summary.of(measured[base][1]).scaled(1e3), **common))
    return rows
