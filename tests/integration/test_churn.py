"""Churn: peers are SIGKILLed and replaced every few seconds while a client generates back to back."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny_llama

SPANS = [(0, 2), (0, 2), (2, 4), (2, 4), (2, 4)]
CHURN_S = 40.0
KILL_EVERY_S = 4.0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-churn", num_layers=4, seed=4)


def test_generations_complete_and_match_under_churn(swarm, model_path):
    prefix = prefix_for_model(str(model_path))
    local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    swarm.start_bootstrap()
    live = [(swarm.start_peer(model_path, "--blocks", f"{a}:{b}"), (a, b)) for a, b in SPANS]
    swarm.wait_online(prefix, sorted(set(SPANS)))
    swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == len(SPANS), 60, "all peers ONLINE")

    rng = random.Random(0)
    kills = 0
    stop = threading.Event()

    def churn():
        # kill a random peer whose blocks another live peer also serves, and start a replacement
        nonlocal kills
        while not stop.wait(KILL_EVERY_S):
            spare = [entry for entry in live if sum(span == entry[1] for _, span in live) > 1]
            victim = rng.choice(spare)
            live.remove(victim)
            swarm.kill(victim[0])
            kills += 1
            live.append((swarm.start_peer(model_path, "--blocks", "%d:%d" % victim[1]), victim[1]))

    remote = AutoDistributedModelForCausalLM.from_pretrained(str(model_path), initial_peers=swarm.initial_peers,
                                                            wait_for_peers_s=30)
    killer = threading.Thread(target=churn, daemon=True)
    generations = 0
    began = time.monotonic()
    try:
        killer.start()
        while time.monotonic() - began < CHURN_S:
            ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(generations))
            expected = local.generate(ids, max_new_tokens=48, do_sample=False)
            got = remote.generate(ids, max_new_tokens=48, do_sample=False)
            assert torch.equal(got, expected), f"generation {generations} differs under churn"
            generations += 1
    finally:
        stop.set()
        killer.join(timeout=30)
        failovers, recovery_s = remote.sequence.failovers, remote.sequence.recovery_s
        remote.shutdown()
    print(f"\nchurn: {generations} generations, {kills} kills, {failovers} failovers, "
          f"{recovery_s:.2f}s in recovery over {time.monotonic() - began:.0f}s")
    assert kills >= CHURN_S // KILL_EVERY_S - 2
    assert generations >= 5
