"""Churn: peers are SIGKILLed and replaced every few seconds while a client generates back to back.

The references (tokens and per-step logits) are computed before the churn starts, so that the local model
does not compete with the dying and starting peers for the CPU; the test asserts that failovers and
recoveries really happened.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from protocol.records import prefix_for_model
from tests.helpers.generation import assert_same_generation, generate_with_logits
from tests.helpers.models import make_tiny_llama
from tests.helpers.peers import process_serving

SPANS = [(0, 2), (0, 2), (2, 4), (2, 4), (2, 4)]
CHURN_S = 14.0
MAX_CHURN_S = 45.0  # churn goes on past CHURN_S until a session was repaired mid-generation, at most this long
NUM_PROMPTS = 10  # references computed up front, then reused in turn
KILL_EVERY_S = 3.0  # with CHURN_S, at least 2 kills are asserted (CHURN_S // KILL_EVERY_S // 2)


def _online(proc) -> bool:
    return proc.alive() and "ONLINE: serving blocks" in proc.stderr()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-churn", num_layers=4, seed=4)


def test_generations_complete_and_match_under_churn(swarm, model_path):
    prefix = prefix_for_model(str(model_path))
    local = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [
        torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(seed)) for seed in range(NUM_PROMPTS)
    ]
    references = [generate_with_logits(local, ids, max_new_tokens=48, do_sample=False) for ids in prompts]
    swarm.start_bootstrap()
    live = [(swarm.start_peer(model_path, "--blocks", f"{a}:{b}"), (a, b)) for a, b in SPANS]
    swarm.wait_online(prefix, sorted(set(SPANS)))
    swarm.wait_for(lambda: len(swarm.snapshot(prefix, 4).online()) == len(SPANS), 60, "all peers ONLINE")

    rng = random.Random(0)
    kills = 0
    stop = threading.Event()

    def in_use(spare):
        """An entry of `spare` that the generation in progress routes through, if any."""
        session = remote._session  # read from the killer thread: a glimpse is enough
        spans = list(session.remote.spans) if session is not None and session.remote is not None else []
        for span in spans:
            try:
                proc = process_serving([proc for proc, _ in spare], span.hop.endpoint)
            except AssertionError:  # that peer has no spare: it is not killed
                continue
            return next(entry for entry in spare if entry[0] is proc)
        return None

    def churn():
        # kill a peer whose blocks another ONLINE peer also serves, and start a replacement; every other kill
        # takes a peer of the generation in progress, so that sessions are repaired, not only re-opened
        nonlocal kills
        while not stop.wait(KILL_EVERY_S):
            spare = [
                entry
                for entry in live
                if any(other is not entry and other[1] == entry[1] and _online(other[0]) for other in live)
            ]
            if not spare:  # replacements still starting: the swarm keeps an ONLINE peer of every span
                continue
            victim = (kills % 2 == 0 and in_use(spare)) or rng.choice(spare)
            live.remove(victim)
            swarm.kill(victim[0])
            kills += 1
            live.append((swarm.start_peer(model_path, "--blocks", f"{victim[1][0]}:{victim[1][1]}"), victim[1]))

    remote = AutoDistributedModelForCausalLM.from_pretrained(
        str(model_path), initial_peers=swarm.initial_peers, wait_for_peers_s=30
    )
    killer = threading.Thread(target=churn, daemon=True)
    generations = 0
    began = time.monotonic()
    try:
        killer.start()
        # on a loaded machine a kill of the generation's peer can land between generations (the next one only
        # re-routes): churn on until one was repaired mid-generation
        while time.monotonic() - began < CHURN_S or (
            remote.sequence.recoveries == 0 and time.monotonic() - began < MAX_CHURN_S
        ):
            turn = generations % NUM_PROMPTS
            got = generate_with_logits(remote, prompts[turn], max_new_tokens=48, do_sample=False)
            assert_same_generation(got, references[turn])
            generations += 1
    finally:
        stop.set()
        killer.join(timeout=30)
        sequence = remote.sequence
        failovers, recoveries, recovery_s = sequence.failovers, sequence.recoveries, sequence.recovery_s
        remote.shutdown()
    print(
        f"\nchurn: {generations} generations, {kills} kills, {failovers} failovers, {recoveries} recoveries, "
        f"{recovery_s:.2f}s in recovery over {time.monotonic() - began:.0f}s"
    )
    assert kills >= CHURN_S // KILL_EVERY_S // 2  # kills wait while no other peer of a span is ONLINE
    assert generations >= 5
    # every other kill took a peer of the generation in progress: sessions were repaired, not only re-opened
    assert failovers >= 1 and recoveries >= 1 and recovery_s > 0
