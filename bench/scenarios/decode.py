"""Decode latency: batch 1, greedy, one new token per forward, the way `generate()` steps.

The swarm runs each step inside an inference session (KV caches on the peers); the reference is the local
Hugging Face model with its DynamicCache, same weights, same dtype. Each forward call is timed, embeddings
and LM head included on both sides. Local and swarm runs alternate, after one warm-up run of each.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from bench.harness import ModelRun, Split, sync_for
from bench.stats import Row, Summary, Target

DECODE_TARGET = Target("ratio", "<=", 1.15, "<= 1.15x local")
TINY_DECODE_TARGET = Target("ratio", "<=", 1.25, "<= 1.25x local")  # per-hop costs show most on a tiny model


def prompt_ids(vocab_size: int, length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def decode_local(model, prompt: torch.Tensor, steps: int, device: str) -> tuple[list[float], list[int]]:
    """Step times (s) and generated tokens of greedy decoding with the local model."""
    sync = sync_for(device)
    cache = DynamicCache(config=model.config)
    times, tokens = [], []
    with torch.inference_mode():
        out = model(prompt.to(device), cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            sync()
            began = time.perf_counter()
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - began)
            tokens.append(int(token))
    return times, tokens


def decode_swarm(client, prompt: torch.Tensor, steps: int) -> tuple[list[float], list[int]]:
    """Step times (s) and generated tokens of greedy decoding through the swarm's inference session."""
    times, tokens = [], []
    with torch.inference_mode(), client.inference_session(max_length=prompt.shape[1] + steps + 1):
        out = client(prompt)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            began = time.perf_counter()
            out = client(token)
            token = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - began)
            tokens.append(int(token))
    return times, tokens


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model = model_run.plan, model_run.model
    reference = model_run.reference
    prompt = prompt_ids(model.config.vocab_size, plan.decode_prompt)
    warm = min(8, plan.decode_steps)
    decode_local(reference, prompt, warm, plan.device)
    decode_swarm(split.client, prompt, warm)
    local_times, swarm_times, matches, local_runs, swarm_runs = [], [], [], [], []
    for _ in range(plan.repeats):
        lt, local_tokens = decode_local(reference, prompt, plan.decode_steps, plan.device)
        st, swarm_tokens = decode_swarm(split.client, prompt, plan.decode_steps)
        local_times += lt
        swarm_times += st
        local_runs.append(sorted(lt)[len(lt) // 2] * 1e3)
        swarm_runs.append(sorted(st)[len(st) // 2] * 1e3)
        matches.append(sum(a == b for a, b in zip(local_tokens, swarm_tokens)) / len(local_tokens))
    target = {"default": DECODE_TARGET, "tiny": TINY_DECODE_TARGET}.get(model.name) if split.count == 3 else None
    ours, local = Summary.of(swarm_times).scaled(1e3), Summary.of(local_times).scaled(1e3)
    return [
        Row(
            scenario="decode",
            config=model.name,
            variant=f"{split.count} peer{'s' * (split.count > 1)}",
            metric="decode step",
            unit="ms",
            ours=ours,
            reference=local,
            reference_name="local HF model",
            target=target,
            extra={
                "steps_per_run": plan.decode_steps,
                "runs": plan.repeats,
                "prompt_tokens": plan.decode_prompt,
                "per_run_median_ms": {"ours": swarm_runs, "reference": local_runs},
                "greedy_tokens_equal_fraction": min(matches),
                "overhead_per_hop_ms": (ours.median - local.median) / split.count,
            },
        )
    ]
