"""Faults during training, injected into real processes: training goes on, finite, and groups heal.

One swarm for the module: stage 0:2 served by two training peers, stage 2:4 by three, and two `swarmlm train`
processes whose batches of 8 together make each update's 16 samples. The tests run in order, each on what the
previous one left: a stage peer killed mid-step, a peer killed during its group's all-reduce, a peer joining
mid-run, a trainer killed, then every remaining role stopped by SIGTERM or Ctrl+C with nothing left behind.
"""

from __future__ import annotations

import json
import math
import signal

import pytest

from client import AutoDistributedModelForCausalLM
from client.training.data import default_corpus
from client.training.export import fetch_peer_weights
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer

GROUP_ATOL = 1e-6  # a group is bit-identical again one round after a fault (see test_training.py)
STEP_TIMEOUT_S = 15  # a trainer waits this long for the other to finish its micro-batches, then updates alone
TRAIN_PEER = [
    "--train",
    "--run-id",
    "faults",
    "--lr",
    "3e-3",
    "--target-batch-size",
    "16",
    "--matchmaking-time-s",
    "1",
    "--averaging-timeout-s",
    "8",
    "--load-state-timeout-s",
    "20",
]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """(swarm, watching client, {trainer name: (process, log path)}, peers by span) with training under way."""
    work = tmp_path_factory.mktemp("faults")
    path = make_tiny("llama", work / "tiny-llama", seed=0)
    save_char_tokenizer(path)
    with Swarm(work / "swarm") as swarm:
        swarm.start_bootstrap()
        peers = {(0, 2): [], (2, 4): []}
        for span in [(0, 2), (0, 2), (2, 4), (2, 4), (2, 4)]:
            peers[span].append(swarm.start_peer(path, "--blocks", f"{span[0]}:{span[1]}", *TRAIN_PEER))
        swarm.wait_online(prefix_for_model(str(path)), [(0, 2), (2, 4)], timeout_s=120)
        swarm.wait_for(lambda: len(swarm.snapshot(prefix_for_model(str(path))).online()) == 5, 120, "5 peers ONLINE")
        play = default_corpus()[0]  # one play is data enough, and quick to tokenize
        trainers = {}
        for name, seed in [("trainer-a", 0), ("trainer-b", 1)]:
            log = work / f"{name}.jsonl"
            trainers[name] = (
                swarm.spawn(
                    name,
                    "train",
                    str(path),
                    "--initial-peers",
                    *swarm.initial_peers,
                    "--run-id",
                    "faults",
                    "--data",
                    str(play),
                    "--seq-len",
                    "32",
                    "--batch-size",
                    "8",
                    "--micro-batch-size",
                    "2",
                    "--steps",
                    "100000",
                    "--lr",
                    "3e-3",
                    "--seed",
                    str(seed),
                    "--step-timeout-s",
                    str(STEP_TIMEOUT_S),
                    "--matchmaking-time-s",
                    "1",
                    "--averaging-timeout-s",
                    "8",
                    "--log-json",
                    str(log),
                    "--no-progress",
                ),
                log,
            )
        client = AutoDistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)
        try:
            for _, log in trainers.values():
                wait_steps(swarm, log, 2)
            yield swarm, client, trainers, peers
        finally:
            client.shutdown()


def steps(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def wait_steps(swarm: Swarm, log, count: int, timeout_s: float = 120) -> list[dict]:
    """Wait until the trainer writing `log` has logged `count` steps; check every loss is finite."""
    records = swarm.wait_for(
        lambda: (r := steps(log)) and len(r) >= count and r, timeout_s, f"{count} steps in {log.name}"
    )
    assert all(math.isfinite(r["loss"]) for r in records), records
    return records


def infos(client) -> dict[str, tuple[tuple[int, int], pb.InfoResponse, str]]:
    """Peer id -> (span, Info, endpoint) of every peer that answers."""
    sequence = client.sequence

    async def ask():
        snapshot = await sequence.snapshot(refresh=True)
        found = {}
        for pid, info in snapshot.online().items():
            try:
                response = await sequence.pool.unary(info.endpoint, "info", pb.InfoRequest(), 2.0)
            except SwarmError:
                continue
            found[pid] = ((info.start_block, info.end_block), response, info.endpoint)
        return found

    return client._run(ask())


def settled_weights(swarm: Swarm, client, span: tuple[int, int], timeout_s: float = 60) -> list[dict]:
    """Weights of every live peer of `span`, read while none of them updates (same epoch before and after)."""
    sequence = client.sequence

    def probe():
        before = {pid: r.epoch for pid, (s, r, _) in infos(client).items() if s == span and not r.updating}
        endpoints = {pid: e for pid, (s, _, e) in infos(client).items() if s == span}
        if len(set(before.values())) != 1 or set(before) != set(endpoints):
            return None
        weights = [
            client._run(fetch_peer_weights(sequence.pool, endpoints[pid], sequence.prefix, *span)) for pid in before
        ]
        after = {pid: r.epoch for pid, (s, r, _) in infos(client).items() if s == span}
        return weights if after == before else None

    return swarm.wait_for(probe, timeout_s, f"the peers of {span} to settle", poll_s=0.05)


def max_difference(weights: list[dict]) -> float:
    first = weights[0]
    return max(float((first[name] - other[name]).abs().max()) for other in weights[1:] for name in first)


def test_sigkill_of_a_stage_peer_mid_step(training):
    swarm, client, trainers, peers = training
    _, log = trainers["trainer-a"]
    done = len(steps(log))
    # mid-step: some peer of the stage holds gradients of the update under way
    swarm.wait_for(
        lambda: any(s == (0, 2) and r.samples for s, r, _ in infos(client).values()),
        60,
        "a micro-batch to reach stage 0:2",
        poll_s=0.02,
    )
    victim = peers[(0, 2)].pop(0)
    swarm.kill(victim, signal.SIGKILL)
    records = wait_steps(swarm, log, done + 2)
    assert records[-1]["samples"] == 8


def test_sigkill_during_an_all_reduce(training):
    swarm, client, trainers, peers = training
    _, log = trainers["trainer-a"]
    endpoints = {}

    def updating():
        found = infos(client)
        endpoints.update({e: pid for pid, (_, _, e) in found.items()})
        return [e for s, r, e in found.values() if s == (2, 4) and r.updating]

    in_round = swarm.wait_for(updating, 60, "stage 2:4 to start averaging", poll_s=0.01)
    victim = process_serving(peers[(2, 4)], in_round[0])
    peers[(2, 4)].remove(victim)
    swarm.kill(victim, signal.SIGKILL)
    done = len(steps(log))
    wait_steps(swarm, log, done + 2)
    weights = settled_weights(swarm, client, (2, 4))
    assert len(weights) == 2
    assert max_difference(weights) < GROUP_ATOL


def test_a_joining_peer_copies_its_group(training):
    swarm, client, trainers, peers = training
    _, log = trainers["trainer-a"]
    newcomer = swarm.start_peer(peers[(2, 4)][0].model_path, "--blocks", "0:2", *TRAIN_PEER)
    peers[(0, 2)].append(newcomer)
    swarm.wait_for(
        lambda: sum(s == (0, 2) for s, _, _ in infos(client).values()) == 2, 120, "the newcomer to serve 0:2"
    )
    assert "copying its state" in newcomer.stderr() or "copied the state" in newcomer.stderr(), newcomer.logs()
    weights = settled_weights(swarm, client, (0, 2))
    assert len(weights) == 2 and max_difference(weights) < GROUP_ATOL
    done = len(steps(log))
    wait_steps(swarm, log, done + 1)
    weights = settled_weights(swarm, client, (0, 2))
    assert max_difference(weights) < GROUP_ATOL


def test_sigkill_of_one_of_two_trainers(training):
    swarm, client, trainers, _peers = training
    victim, _ = trainers["trainer-b"]
    survivor, log = trainers["trainer-a"]
    swarm.kill(victim, signal.SIGKILL)
    done = len(steps(log))
    epochs = {r.epoch for s, r, _ in infos(client).values()}
    wait_steps(swarm, log, done + 2, timeout_s=180)
    assert survivor.alive()
    # the stages still update: the survivor's samples alone fill them
    swarm.wait_for(
        lambda: min(r.epoch for s, r, _ in infos(client).values()) > max(epochs),
        120,
        "every stage to update on the surviving trainer's samples",
    )


def test_sigterm_and_ctrl_c_stop_every_role(training):
    swarm, _client, trainers, peers = training
    trainer, _log = trainers["trainer-a"]
    swarm.signal_process_group(trainer, signal.SIGINT)  # Ctrl+C in its terminal
    assert not trainer.wait_gone(60), trainer.logs()  # gone, with its DHT node and averager process
    assert trainer.returncode != 0 and "interrupted" in trainer.stderr(), trainer.logs()
    for proc in [peers[(0, 2)][0], peers[(2, 4)][0]]:  # each with its averager process
        assert swarm.terminate(proc, timeout_s=60) == 0, proc.logs()
