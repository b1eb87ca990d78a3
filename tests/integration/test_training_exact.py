"""Training you can trust: one run through every fault and attack, equal to local training step for step.

One swarm, one trainer and its local reference (`client/training/local.py`), which sees exactly the same batches.
Stage 0:2 has two peers, one of them behind a proxy that can drop answers (tests/helpers/liar.py); stage 2:4 has
three. The recipe warms up, decays by cosine, clips by the global norm and decays weights, so that the schedule,
the clipping and the spared parameters are checked too. Step after step, a fault or an attack is injected while
the trainer works:

- none;
- two of a stage's three members SIGSTOPped as the step begins, continued once the step is under way (they sit
  the update out, then copy the state of the one that took part, although those behind outnumber it);
- a member SIGSTOPped mid-step for longer than the Info timeout, then continued (it is slow, not lost);
- a backward whose answer is lost after the member added it (the proxy drops it: the trainer asks again);
- a member SIGKILLed after it took part of the step (fenced; its micro-batches go to the other member);
- a member SIGKILLed during its stage's round (the round fails; the update is committed again without it);
- a stranger announcing a far higher epoch and serving a poisoned state to a peer that joins, and sending a
  gradient a million times the usual; the joiner copies the honest state;
- a trainer that commits an update at every member and vanishes before applying it (as one SIGKILLed between
  its commit and its Apply): the members drop its commit once it has no live record, and the trainer's
  micro-batches, refused meanwhile, go into that update;
- the trainer stopped, and a new one resumed from its saved state.

After every step: the loss equals the reference's, every stage and the trainer applied exactly the batch's
samples, and the weights of every live member and of the trainer equal the reference's.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from client import AutoDistributedModelForCausalLM, SwarmTrainer, TrainConfig
from client.training.export import fetch_peer_weights
from client.training.local import LocalTrainer
from protocol import swarmlm_pb2 as pb
from protocol.errors import SwarmError
from protocol.records import TrainingProgress, prefix_for_model
from swarm.dht.node import start_dht, stop_dht
from swarm.training.group import GroupMember, group_key
from swarm.training.members import GroupProgress
from swarm.training.settings import AveragingSettings
from swarm.training.state import state_digest
from tests.helpers.models import VOCAB_SIZE, make_tiny
from tests.helpers.peers import process_serving
from tests.helpers.processes import Swarm

pytestmark = pytest.mark.timeout(600)

LIAR = Path(__file__).resolve().parents[1] / "helpers" / "liar.py"
RUN = "exact"
SEQ_LEN, BATCH, MICRO = 32, 8, 2
RECIPE = {"lr": 3e-3, "warmup_steps": 2, "lr_schedule": "cosine", "total_steps": 12, "max_grad_norm": 0.5,
          "weight_decay": 0.01}  # fmt: skip
RECIPE_FLAGS = ["--lr", "3e-3", "--warmup-steps", "2", "--lr-schedule", "cosine", "--total-steps", "12",
                "--max-grad-norm", "0.5", "--weight-decay", "0.01"]  # fmt: skip
AVERAGING = AveragingSettings(matchmaking_time_s=1.0, averaging_timeout_s=8.0, load_state_timeout_s=20.0)
PEER = ["--train", "--run-id", RUN, "--target-batch-size", str(BATCH), "--matchmaking-time-s", "1",
        "--averaging-timeout-s", "8", "--load-state-timeout-s", "20", *RECIPE_FLAGS]  # fmt: skip
ATOL = 1e-4  # the reference sums in another order; Adam divides by |g| + eps (see test_training.py)
STOPPED_S = 7.0  # longer than the trainer's 5 s Info timeout, shorter than a record's 15 s lifetime


class Run:
    """The swarm, the trainer, the reference, and the checks after each step."""

    def __init__(self, swarm: Swarm, path: Path, mode_file: Path):
        self.swarm, self.path, self.mode_file = swarm, path, mode_file
        self.prefix = prefix_for_model(str(path))
        self.generator = torch.Generator().manual_seed(0)
        self.local = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **RECIPE))
        self.model = self.trainer = None
        self.steps = 0
        self.faults: list[tuple[int, str]] = []  # (step, fault) of every step so far
        self.seen_at: dict[str, int] = {}  # member -> the last step after which it was at the trainer's update
        self.peers: dict[tuple[int, int], list] = {(0, 2): [], (2, 4): []}

    def connect(self, state: dict | None = None, head: dict | None = None) -> None:
        self.model = AutoDistributedModelForCausalLM.from_pretrained(
            str(self.path), initial_peers=self.swarm.initial_peers, dtype=torch.float32
        )
        if head is not None:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(head[name])
        config = TrainConfig(run_id=RUN, batch_size=BATCH, micro_batch_size=MICRO, averaging=AVERAGING)
        self.trainer = SwarmTrainer(self.model, config, epoch=None if state is None else state["epoch"])
        if state is not None:
            self.trainer.load_state_dict(state)
        assert self.trainer.recipe == self.local.recipe  # the run's recipe, adopted, is the reference's

    def disconnect(self) -> tuple[dict, dict]:
        state = self.trainer.state_dict()
        head = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.trainer.close()
        self.model.shutdown()
        self.trainer = self.model = None
        return state, head

    def infos(self, span: tuple[int, int], refresh: bool = True) -> dict[str, tuple[pb.InfoResponse, str]]:
        """Peer id -> (Info, endpoint) of every live peer of `span` (`refresh`: as the directory says now)."""
        sequence = self.model.sequence

        async def ask():
            snapshot = await sequence.snapshot(refresh=refresh)
            found = {}
            for pid, info in snapshot.online().items():
                if (info.start_block, info.end_block) != span:
                    continue
                try:
                    found[pid] = (
                        await sequence.pool.unary(info.endpoint, "info", pb.InfoRequest(), 2.0),
                        info.endpoint,
                    )
                except SwarmError:
                    continue
            return found

        return self.model._run(ask())

    def step(self, fault=None):
        """One step of the trainer (a fault injected meanwhile by `fault(done)`) and of the reference; checks."""
        batch = torch.randint(3, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=self.generator)
        result, error, done = [], [], threading.Event()

        def train():
            try:
                result.append(self.trainer.step(batch))
            except BaseException as exc:
                error.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=train)
        thread.start()
        if fault is not None:
            fault(done)
        thread.join(timeout=300)
        assert not error, f"step {self.steps} failed: {error[0]!r}\n{self.swarm.format_logs()}"
        assert result, f"step {self.steps} did not finish\n{self.swarm.format_logs()}"
        reference = self.local.step(batch)
        (mine,) = result
        self.steps += 1
        assert mine.loss == pytest.approx(reference.loss, rel=1e-4), (mine, reference)
        # every micro-batch once: every stage and the trainer applied exactly the batch
        assert mine.stage_samples == {(0, 2): BATCH, (2, 4): BATCH}, mine
        assert mine.trainer_samples == BATCH, mine
        self.faults += [(self.steps, fault) for fault in mine.faults]
        self.check_weights(mine)
        return mine

    def check_weights(self, step) -> None:
        """Every live member's weights and the trainer's equal the reference's; a member that sat the update out
        (the step names it) first copies its group's state."""
        local = self.local.model.state_dict()
        sequence = self.model.sequence
        for span in [(0, 2), (2, 4)]:
            found = self.caught_up(span, step)
            for pid, (_, endpoint) in found.items():
                weights = self.model._run(fetch_peer_weights(sequence.pool, endpoint, sequence.prefix, *span))
                worst = max(float((weights[n] - local[n]).abs().max()) for n in weights)
                assert worst < ATOL, (self.steps, span, pid, worst, step, self.swarm.format_logs())
        for name, p in self.model.named_parameters():
            assert float((p.detach() - local[name]).abs().max()) < ATOL, (self.steps, name)

    def caught_up(self, span, step, timeout_s: float = 60.0) -> dict[str, tuple[pb.InfoResponse, str]]:
        """The live members of `span` once all are at the trainer's update; one behind must be named by the step,
        or by an earlier one and not caught up since (the trainer names a member that the directory misses at two
        updates in a row only once)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.infos(span)
            assert found, f"no live member of {span}"
            behind = [pid for pid, (info, _) in found.items() if info.epoch != self.trainer.epoch]
            self.seen_at.update((pid, self.steps) for pid in found if pid not in behind)
            if not behind:
                return found
            for pid in behind:
                named = [f for at, f in self.faults if at > self.seen_at.get(pid, 0) and pid[-8:] in f]
                assert named, (self.steps, span, pid, step.faults, self.swarm.format_logs())
            assert time.monotonic() < deadline, (self.steps, span, behind, "did not catch up", self.swarm.format_logs())
            time.sleep(0.5)

    def process_of(self, span, endpoint: str):
        return process_serving(self.peers[span], endpoint)

    def when(self, span, test, done, timeout_s: float = 60.0, poll_s: float = 0.02):
        """(peer id, endpoint) of the first member of `span` whose Info passes `test`, while the step runs."""
        deadline = time.monotonic() + timeout_s
        refresh = True  # the directory once, then only the members' Info: a round lasts a fraction of a second
        while not done.is_set() and time.monotonic() < deadline:
            for pid, (info, endpoint) in self.infos(span, refresh).items():
                if test(info):
                    return pid, endpoint
            refresh = False
            time.sleep(poll_s)
        return None


def test_one_run_through_every_fault_and_attack_equals_local_training(tmp_path):
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=0)
    mode_file = tmp_path / "liar-mode.json"
    with Swarm(tmp_path / "swarm") as swarm:
        run = Run(swarm, path, mode_file)
        swarm.start_bootstrap()
        run.peers[(0, 2)].append(swarm.start_peer(path, "--blocks", "0:2", *PEER))
        liar = swarm.start_peer(path, "--blocks", "0:2", *PEER, command=[sys.executable, str(LIAR), str(mode_file)])
        run.peers[(0, 2)].append(liar)
        for _ in range(3):
            run.peers[(2, 4)].append(swarm.start_peer(path, "--blocks", "2:4", *PEER))
        swarm.wait_for(lambda: len(swarm.snapshot(run.prefix, 4).online()) == 5, 120, "5 peers ONLINE")
        run.connect()
        try:
            # no fault
            run.step()

            # two of the three members stopped as the step begins, continued once the step is under way without
            # them: they sit the update out (the step says so), then copy the state of the one that took part.
            # Behind, they outnumber it; the record of a fourth member that sat the update out too (and stays
            # behind: its record only) makes that so whichever of the two republishes first. Only the trainers'
            # records tell which update the group is at.
            late = dict(list(run.infos((2, 4)).items())[:2])
            procs = [run.process_of((2, 4), endpoint) for _, endpoint in late.values()]
            for proc in procs:
                swarm.kill(proc, signal.SIGSTOP)
            behind = start_dht(swarm.initial_peers)
            behind_record = GroupProgress(behind, group_key(run.prefix, RUN, "2-4"), ttl_s=60)
            try:
                behind_record.publish(TrainingProgress(epoch=run.trainer.epoch, samples=0, param_digest="b" * 64))

                def continue_once_under_way(done):
                    run.when((2, 4), lambda info: info.samples > 0, done)  # the update's members are chosen by then
                    for proc in procs:
                        swarm.kill(proc, signal.SIGCONT)
                        proc.expected_alive = True

                skipped = run.step(continue_once_under_way)
                for pid in late:
                    assert any(pid[-8:] in f and "sits it out" in f for f in skipped.faults), skipped.faults
            finally:
                behind_record.leave()
                stop_dht(behind)

            # a member stopped mid-step, longer than the Info timeout, then continued: waited for, not fenced
            # (a step can end before a poll of the members' Info sees it under way, on a busy machine: each fault
            # is tried on up to four steps, every one of them checked against the reference)
            stopped = []

            def stop_and_continue(done):
                found = run.when((2, 4), lambda info: info.samples > 0, done)
                if found is not None:
                    proc = run.process_of((2, 4), found[1])
                    swarm.kill(proc, signal.SIGSTOP)
                    time.sleep(STOPPED_S)
                    swarm.kill(proc, signal.SIGCONT)
                    proc.expected_alive = True
                    stopped.append(found[0])

            for _ in range(4):
                stalled = run.step(stop_and_continue)
                assert not any("gone" in f for f in stalled.faults), stalled.faults
                if stopped:
                    break
            assert stopped, "no member of 2:4 was seen holding a micro-batch mid-step"

            # a backward's answer lost after the member added it: asked again of the same member
            mode_file.write_text(json.dumps({"lie": "lose", "on": "backward", "times": 1}))
            for _ in range(4):  # until a micro-batch's backward went through the proxy
                run.step()
                if "lied: lose on Backward" in liar.stdout():
                    break
            assert "lied: lose on Backward" in liar.stdout(), liar.logs()
            mode_file.write_text(json.dumps({"lie": "honest"}))

            # a member killed after it took part of the step: fenced, its micro-batches sent to the other one
            killed_ids = []

            def kill_a_holder(done):
                found = run.when((0, 2), lambda info: info.samples > 0, done)
                if found is not None:
                    proc = run.process_of((0, 2), found[1])
                    run.peers[(0, 2)].remove(proc)
                    swarm.kill(proc, signal.SIGKILL)
                    killed_ids.append(found[0])

            for _ in range(4):
                killed = run.step(kill_a_holder)
                if killed_ids:
                    break
            assert killed_ids, "no member of 0:2 was seen holding a micro-batch mid-step"
            assert any("gone" in f or "commit failed" in f for f in killed.faults) or len(run.infos((0, 2))) == 1

            # a member killed during its stage's round: the round fails, the update is committed again without it
            caught = []

            def kill_in_round(done):
                found = run.when((2, 4), lambda info: info.round.state == pb.RoundStatus.AVERAGING, done, poll_s=0.0)
                if found is not None:
                    proc = run.process_of((2, 4), found[1])
                    swarm.kill(proc, signal.SIGSTOP)  # stuck mid-round, then gone for good
                    swarm.kill(proc, signal.SIGKILL)
                    run.peers[(2, 4)].remove(proc)
                    caught.append(found[0])

            for _ in range(6):  # a round lasts a fraction of a second: until one was caught in it
                run.step(kill_in_round)
                if caught:
                    break
            assert caught, "no step's round of 2:4 was caught under way"

            # a stranger: a far higher epoch, a poisoned state for a joiner, a gradient a million times the usual
            stranger = start_dht(swarm.initial_peers)
            poisoner = None
            try:
                key = group_key(run.prefix, RUN, "2-4")
                epoch = run.trainer.epoch
                like = [t.detach().clone() for t in run_state_like(run)]
                poison = [torch.full_like(t, 7.0) for t in like]  # the right shapes, the wrong values
                poisoner = GroupMember(
                    stranger,
                    key,
                    grads_like=like[: len(like) // 3],  # the masters: what rounds average
                    state=lambda: (epoch, poison),
                    settings=AVERAGING,
                )
                poisoner.serve_state()
                poisoner.publish(TrainingProgress(epoch=epoch, samples=0, param_digest=state_digest(poison)))
                for part in ("0-2", "trainers"):
                    GroupProgress(stranger, group_key(run.prefix, RUN, part), ttl_s=60).publish(
                        TrainingProgress(epoch=999, samples=0, param_digest="0" * 64)
                    )
                attack_with_a_huge_gradient(run, epoch)
                joiner = swarm.start_peer(path, "--blocks", "2:4", *PEER)
                run.peers[(2, 4)].append(joiner)
                swarm.wait_for(lambda: "ONLINE" in joiner.stderr(), 120, "the joiner to be ONLINE")
                assert "refused the state" in joiner.stderr() or "copied the state" in joiner.stderr(), joiner.logs()
                run.step()
                run.step()
            finally:
                if poisoner is not None:
                    poisoner.shutdown()
                stop_dht(stranger)

            # a trainer that committed the update everywhere, alone, and vanished before applying it
            commit_as_a_vanished_trainer(run, run.trainer.epoch)
            run.step()

            # the trainer stopped, and a new one resumed from its state
            state, head = run.disconnect()
            run.connect(state, head)
            run.step()
        finally:
            if run.trainer is not None:
                run.trainer.close()
            if run.model is not None:
                run.model.shutdown()


def run_state_like(run: Run) -> list[torch.Tensor]:
    """A 2:4 member's state as the member builds it (masters, then the optimizer's statistics), from the checkpoint."""
    from peer.blocks import load_span
    from peer.config import TrainingConfig
    from peer.training.span import SpanTraining
    from swarm.models.checkpoint import load_config

    span = load_span(run.path, load_config(run.path), 2, 4, dtype=torch.float32, device=torch.device("cpu"))
    return SpanTraining(span, TrainingConfig(run_id=RUN), run.trainer.recipe, run.prefix).state()


def attack_with_a_huge_gradient(run: Run, epoch: int) -> None:
    """A stranger's backward with a gradient a million times the usual, on a live member of 2:4: refused or left
    out of every update (no commit names it)."""
    sequence = run.model.sequence
    (pid, (_, endpoint)), *_ = run.infos((2, 4)).items()
    hidden = torch.randn(1, SEQ_LEN, run.model.config.hidden_size)
    from client.routing import RouteHop
    from client.sequence import TrainingTag

    hop = RouteHop(pid, 2, 4, endpoint)
    tag = TrainingTag(RUN, {(2, 4): epoch}, ("QmStranger", 0, 1))
    try:
        run.model._run(sequence._call_backward(hop, hidden, hidden * 1e6, None, torch.arange(SEQ_LEN)[None], "", tag))
    except SwarmError:
        pass  # refused as an outlier: fine either way


def commit_as_a_vanished_trainer(run: Run, epoch: int) -> None:
    """Commit update `epoch` at every member of both stages in the name of a trainer of its own that has no record
    (it died): each member's round goes on without the real trainer, whose micro-batches it then refuses as late."""
    for span in [(0, 2), (2, 4)]:
        for pid, (_, endpoint) in run.infos(span).items():
            request = pb.CommitRequest(
                run_id=RUN,
                span=pb.Span(model=run.prefix, start=span[0], end=span[1]),
                epoch=epoch,
                trainer="QmVanished",
                trainers=["QmVanished"],
                members=[pb.Holding(peer_id=pid)],
            )
            status = run.model._run(run.model.sequence.pool.unary(endpoint, "commit", request, 5.0)).status
            assert status.state in (pb.RoundStatus.AVERAGING, pb.RoundStatus.AVERAGED), status


def test_peers_computing_in_bfloat16_keep_float32_masters_and_track_float32_training(tmp_path):
    """bfloat16 blocks train on float32 masters: norm weights (1.0) move by updates far below bfloat16's 2^-7
    spacing there, and the run stays within bfloat16 rounding of float32 local training."""
    path = make_tiny("llama", tmp_path / "tiny-llama", seed=0)
    recipe = {"lr": 1e-3}
    flags = ["--train", "--run-id", "bf16", "--target-batch-size", str(BATCH), "--lr", "1e-3", "--dtype", "bfloat16",
             "--matchmaking-time-s", "1"]  # fmt: skip
    with Swarm(tmp_path / "swarm") as swarm:
        swarm.start_bootstrap()
        for span in ["0:2", "2:4"]:
            swarm.start_peer(path, "--blocks", span, *flags)
        prefix = prefix_for_model(str(path))
        swarm.wait_online(prefix, [(0, 2), (2, 4)], timeout_s=120)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            str(path), initial_peers=swarm.initial_peers, dtype=torch.float32
        )
        trainer = None
        try:
            config = TrainConfig(run_id="bf16", batch_size=BATCH, micro_batch_size=MICRO, averaging=AVERAGING)
            trainer = SwarmTrainer(model, config)
            local = LocalTrainer(path, TrainConfig(batch_size=BATCH, micro_batch_size=MICRO, **recipe))
            generator = torch.Generator().manual_seed(0)
            for _ in range(6):
                batch = torch.randint(3, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=generator)
                mine, reference = trainer.step(batch), local.step(batch)
                assert mine.loss == pytest.approx(reference.loss, rel=2e-2), (mine, reference)
                assert mine.stage_samples == {(0, 2): BATCH, (2, 4): BATCH}, mine
            sequence = model.sequence
            served = {}
            for span, info in [((0, 2), None), ((2, 4), None)]:
                (info,) = [
                    i for i in swarm.snapshot(prefix, 4).online().values() if (i.start_block, i.end_block) == span
                ]
                served |= model._run(fetch_peer_weights(sequence.pool, info.endpoint, sequence.prefix, *span))
            norms = [name for name in served if name.endswith("layernorm.weight")]
            assert norms
            # 6 updates of 1e-3 on 1.0: visible in bfloat16 only because the masters are float32 (alone, each
            # update rounds away)
            assert all(float((served[n].float() - 1.0).abs().max()) >= 2**-7 for n in norms), norms
            local_state = local.model.state_dict()
            for name, tensor in served.items():
                assert tensor.dtype == torch.bfloat16
                worst = float((tensor.float() - local_state[name]).abs().max())
                assert worst <= 2**-7 * max(1.0, float(local_state[name].abs().max())), (name, worst)
        finally:
            if trainer is not None:
                trainer.close()
            model.shutdown()
