"""Faults of `swarmlm train` processes: two trainers share a run, one is killed, and every role stops cleanly.

One swarm for the module: each stage served by two training peers, and two `swarmlm train` processes whose
batches of 8 together make each update's 16 samples. The tests run in order, each on what the previous one left:
a stage peer killed mid-step, a trainer killed, then every remaining role stopped by SIGTERM or Ctrl+C with
nothing left behind. Exactness under faults (a member stopped, killed mid-step or in its round, a lost answer, a
joiner, a resumed trainer) is test_training_exact.py's, against a local reference.
"""

from __future__ import annotations

import json
import math
import signal

import pytest

from client import AutoDistributedModelForCausalLM
from client.training.data import default_corpus
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import prefix_for_model
from tests.helpers.models import make_tiny
from tests.helpers.processes import Swarm
from tests.helpers.tokenizer import save_char_tokenizer

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
        for span in [(0, 2), (0, 2), (2, 4), (2, 4)]:
            peers[span].append(swarm.start_peer(path, "--blocks", f"{span[0]}:{span[1]}", *TRAIN_PEER))
        swarm.wait_online(prefix_for_model(str(path)), [(0, 2), (2, 4)], timeout_s=120)
        swarm.wait_for(lambda: len(swarm.snapshot(prefix_for_model(str(path))).online()) == 4, 120, "4 peers ONLINE")
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
    """Wait until the trainer writing `log` has logged `count` steps; check every loss is finite, and that every
    stage applied each update's samples once: those of the trainers of the update, whatever failed meanwhile."""
    records = swarm.wait_for(
        lambda: (r := steps(log)) and len(r) >= count and r, timeout_s, f"{count} steps in {log.name}"
    )
    assert all(math.isfinite(r["loss"]) for r in records), records
    for r in records:
        assert set(r["stage_samples"].values()) == {r["trainer_samples"]}, r
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
