"""A wide-area network, emulated: every peer of a 3-peer split is announced behind its own delaying proxy
(bench/proxy.py), so every connection to it, the client's and the other peers', pays a one-way delay.

Decode steps and a prefill are timed at each delay with steps pushed from peer to peer (`forward_steps=True`;
the default, "auto", does so towards peers 5 ms or more away) and with every hop's step sent by the client. Each is reported next to its floor: the one-way legs of its route times
the delay (peer to peer: client -> p1 -> p2 -> p3 -> client, 4 legs; client-driven: 2 per peer, 6) plus the
compute, which is the same path measured at 0 ms in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import ModelRun, Split
from bench.scenarios.decode import decode_swarm, prompt_ids
from bench.stats import Row, Summary, Target

TARGET = Target("ratio", "<=", 1.15, "<= 1.15x the floor")


def _prefill_s(client, prompt: torch.Tensor) -> float:
    began = time.perf_counter()
    with torch.inference_mode(), client.inference_session(max_length=prompt.shape[1]):
        client(prompt)
    return time.perf_counter() - began


def run(model_run: ModelRun, split: Split) -> list[Row]:
    plan, model = model_run.plan, model_run.model
    if not split.proxies:
        raise ValueError("the wan scenario needs a split whose peers are behind proxies (split(delayed=True))")
    client_driven = model_run.connect(split.prefix, forward_steps=False)
    peer_to_peer = model_run.connect(split.prefix, forward_steps=True)
    clients = {"peer to peer": (peer_to_peer, split.count + 1), "client-driven": (client_driven, 2 * split.count)}
    prompt = prompt_ids(model.config.vocab_size, plan.decode_prompt)
    long_prompt = prompt_ids(model.config.vocab_size, plan.wan_prefill, seed=1)
    steps: dict[tuple[str, int], list[float]] = {}
    prefills: dict[tuple[str, int], list[float]] = {}
    try:
        for delay_ms in sorted({0, *plan.wan_delays_ms}):
            for proxy in split.proxies:
                proxy.delay_s = delay_ms / 1000
            for name, (client, _) in clients.items():
                decode_swarm(client, prompt, 2)  # warm-up, and new connections at this delay
                steps[name, delay_ms] = [
                    t for _ in range(plan.repeats) for t in decode_swarm(client, prompt, plan.wan_steps)[0]
                ]
                prefills[name, delay_ms] = [_prefill_s(client, long_prompt) for _ in range(plan.repeats)]
    finally:
        client_driven.shutdown()
        peer_to_peer.shutdown()
        for proxy in split.proxies:
            proxy.delay_s = 0.0
    rows = []
    for (name, delay_ms), times in steps.items():
        legs = clients[name][1]
        for metric, measured in (
            ("decode step", times),
            (f"prefill {plan.wan_prefill} tokens", prefills[name, delay_ms]),
        ):
            source = steps if metric == "decode step" else prefills
            compute = statistics.median(source[name, 0])
            floor = legs * delay_ms / 1000 + compute
            rows.append(
                Row(
                    scenario="wan",
                    config=model.name,
                    variant=f"{split.count} peers, {delay_ms} ms one-way, {name}",
                    metric=metric,
                    unit="ms",
                    ours=Summary.of(measured).scaled(1e3),
                    reference=Summary.of([floor]).scaled(1e3),
                    reference_name=f"floor: {legs} legs x {delay_ms} ms + the same at 0 ms",
                    target=TARGET if name == "peer to peer" and delay_ms and metric == "decode step" else None,
                    extra={
                        "notes": [
                            "delay: bench/proxy.py DelayProxy in front of each peer's gRPC port, which the peer "
                            "announces; DHT traffic is not delayed"
                        ]
                    },
                )
            )
    return rows
