"""Prefill: one forward over a whole prompt at the start of a generation, vs the local model.

The swarm's call opens a fresh inference session, so the per-peer session opening (one round trip each) is
part of what a user waits for and is included; the local model starts a fresh DynamicCache. Logits are
computed for every position on both sides (what a plain forward does).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from bench.harness import ModelRun, Split, sync_for
from bench.scenarios.decode import prompt_ids
from bench.stats import Row, Summary, time_call


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model, client = model_run.plan, model_run.model, split.client
    reference = model_run.reference
    sync = sync_for(plan.device)
    rows = []
    for length in plan.prefill_lengths:
        prompt = prompt_ids(model.config.vocab_size, length, seed=length)
        device_prompt = prompt.to(plan.device)

        def local():
            with torch.inference_mode():
                reference(device_prompt, cache=DynamicCache(config=reference.config), use_cache=True)

        def swarm():
            with torch.inference_mode(), client.inference_session(max_length=length):
                client(prompt)

        local_s, swarm_s = [], []
        time_call(local, sync)
        time_call(swarm)
        for _ in range(plan.repeats):
            local_s.append(time_call(local, sync))
            swarm_s.append(time_call(swarm))
        variant = f"{split.count} peer{'s' * (split.count > 1)}, {length} tokens"
        common = dict(scenario="prefill", config=model.name, variant=variant, reference_name="local HF model")
        rows.append(
            Row(
                metric="prefill time",
                unit="ms",
                ours=Summary.of(swarm_s).scaled(1e3),
                reference=Summary.of(local_s).scaled(1e3),
                **common,
            )
        )
        rows.append(
            Row(
                metric="prefill throughput",
                unit="tokens/s",
                ours=Summary.of([length / s for s in swarm_s]),
                reference=Summary.of([length / s for s in local_s]),
                **common,
            )
        )
    return rows
