"""The outer sync of a stage's members (`--local-steps`), on real hivemind DHT nodes and averager processes: a sync
round that completes at one member and not at the other is tried again by both, so that no member takes an outer
step the other skips (which left a pair apart for good: each later sync moves each member from its own anchor)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading

import pytest
import torch

from peer.blocks import load_span
from peer.config import TrainingConfig
from peer.training.commits import RoundPlan
from peer.training.span import SpanTraining
from protocol import swarmlm_pb2 as pb
from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.models.checkpoint import load_config
from swarm.training.recipe import RunRecipe
from swarm.training.settings import AveragingSettings
from tests.helpers.models import make_tiny

AVERAGING = AveragingSettings(
    matchmaking_time_s=1.0, averaging_timeout_s=6.0, load_state_timeout_s=6.0, progress_period_s=0.2
)
RECIPE = RunRecipe(lr=1e-2, local_steps=2)
ROUND = "ab" * 32


def member(checkpoint, recipe: RunRecipe = RECIPE) -> SpanTraining:
    span = load_span(checkpoint, load_config(checkpoint), 0, 2, dtype=torch.float32, device=torch.device("cpu"))
    return SpanTraining(span, TrainingConfig(run_id="sync", averaging=AVERAGING), recipe, "model")


@pytest.fixture
def pair(tmp_path):
    """Two members of one stage's group, each on its own DHT node, publishing their progress as a peer does (their
    records then carry each try's outcome between tries too); stopped at the end, also on failure."""
    with members_of(tmp_path, RECIPE) as found:
        yield found


@pytest.fixture
def overlapped_pair(tmp_path):
    """The same with overlapped syncs (--sync-overlap 1)."""
    with members_of(tmp_path, dataclasses.replace(RECIPE, sync_overlap=1)) as found:
        yield found


@contextlib.contextmanager
def members_of(tmp_path, recipe: RunRecipe):
    checkpoint = make_tiny("llama", tmp_path, num_layers=2, seed=3)
    dhts, members, stop = [], [], threading.Event()

    def publish_forever(training: SpanTraining) -> None:
        while not stop.wait(AVERAGING.progress_period_s):
            training.group.publish(training.progress())

    publishers = []
    try:
        for _ in range(2):
            dhts.append(start_dht(visible_maddrs(dhts[0]) if dhts else ()))
            training = member(checkpoint, recipe)
            training.start_group(dhts[-1])
            training.group.publish(training.progress())
            training.group.serve_state(True)
            members.append(training)
            publishers.append(threading.Thread(target=publish_forever, args=(training,), daemon=True))
            publishers[-1].start()
        yield checkpoint, members
    finally:
        stop.set()
        for thread in publishers:
            thread.join(timeout=5)
        for training in members:
            with contextlib.suppress(Exception):
                training.group.shutdown()
        for dht in dhts:
            stop_dht(dht)


def own_gradients(training: SpanTraining, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(m.shape, generator=generator) for m in training.masters]


async def run_compute(fn):
    return await asyncio.to_thread(fn)


async def apply_update(training: SpanTraining, seed: int, members: tuple[str, ...]) -> None:
    """Update `training.epoch` with the member's own gradients, as an Apply of the update's round does."""
    status = pb.RoundStatus(
        epoch=training.epoch, state=pb.RoundStatus.AVERAGED, round_id=f"{training.epoch:02x}" + ROUND[2:]
    )
    training._plan = RoundPlan(status.round_id, 1, ("trainer",), members, {}, 2)
    await training._apply_local_steps(own_gradients(training, seed), 1.0, status, run_compute)


async def commit_and_apply(pair: list[SpanTraining], seeds: tuple[int, ...]) -> list[pb.RoundStatus]:
    """Update 0 through the members' Commit and Apply handlers, as a trainer drives it: each member holds one
    micro-batch of its own; the commits' answers."""
    span = pb.Span(model="model", start=0, end=2)
    holdings = []
    for index, (training, seed) in enumerate(zip(pair, seeds)):
        training.accumulators.add("trainer", index, 1, own_gradients(training, seed))
        held = [pb.TrainerIndices(trainer="trainer", indices=[index], samples=1)]
        holdings.append(pb.Holding(peer_id=training.group.peer_id, held=held))
    request = pb.CommitRequest(
        run_id="sync", span=span, epoch=0, version=1, trainer="trainer", trainers=["trainer"], members=holdings
    )
    answers = [await training.commit(request) for training in pair]
    for training, answer in zip(pair, answers):
        apply = pb.ApplyRequest(
            run_id="sync", span=span, epoch=0, round_id=answer.round_id, grad_digest=answer.grad_digest, clip_scale=1
        )
        await training.apply(apply, run_compute)
    return answers


def expected_after_sync(checkpoint) -> list[torch.Tensor]:
    """Both members' two updates in one process, without a group: the outer step from the first weights with the
    mean of their pseudo-gradients."""
    references = [member(checkpoint) for _ in range(2)]
    for reference, seeds in zip(references, ((0, 2), (1, 3))):
        # a micro-batch of one sample: its gradients are the mean over the update's samples here
        reference._apply(own_gradients(reference, seeds[0]), 1.0, pb.RoundStatus(epoch=0))
        reference._inner_step(own_gradients(reference, seeds[1]), 1.0)
    first, second = (r.outer.pseudo_gradients() for r in references)
    references[0].outer.apply([(x + y) / 2 for x, y in zip(first, second)])
    return references[0].masters


def lose_first_answer(training: SpanTraining) -> list[bool]:
    """Make `training`'s first round end incomplete after it completed (as on a link that drops its last answer);
    whether each try completed."""
    tries = []
    real = training.group.average

    def loses_its_first_answer(tensors, *, round_id, members, timeout_s):
        result = real(tensors, round_id=round_id, members=members, timeout_s=timeout_s)
        tries.append(result.complete)
        if len(tries) == 1:
            return dataclasses.replace(result, complete=False, tensors=None, reason="an answer was lost")
        return result

    training.group.average = loses_its_first_answer
    return tries


def test_a_sync_complete_at_one_member_only_is_tried_again_by_both(pair):
    """The second member's first try completes, and its last answer is lost (as on a link that drops it): it must
    not be the only one to skip the outer step. Both try again, and end with the same weights as one process."""
    checkpoint, (first, second) = pair
    members = tuple(sorted(t.group.peer_id for t in (first, second)))
    tries = lose_first_answer(second)

    async def two_updates():
        answers = await commit_and_apply([first, second], (0, 1))  # update 0: an inner step only
        # update 1: the inner step, then the sync, at both members at once
        await asyncio.gather(apply_update(first, 2, members), apply_update(second, 3, members))
        return answers

    answers = asyncio.run(asyncio.wait_for(two_updates(), 120))
    # with local steps a member averages with no one at an update: its Commit answers once that is done, so the
    # trainer learns it without another look
    assert [a.state for a in answers] == [pb.RoundStatus.AVERAGED] * 2
    assert tries == [True, True]
    assert first.epoch == second.epoch == 2
    assert first.digest() == second.digest(), "the members took different outer steps"
    for ours, theirs, reference in zip(first.masters, second.masters, expected_after_sync(checkpoint)):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)


def test_an_overlapped_sync_complete_at_one_member_only_is_tried_again_by_both(overlapped_pair):
    """The same with --sync-overlap 1: the members go on to update 2 while they try the sync again (agreeing in
    their records' sync fields, as their updates move on), and land the same outer step after it."""
    checkpoint, (first, second) = overlapped_pair
    members = tuple(sorted(t.group.peer_id for t in (first, second)))
    tries = lose_first_answer(second)

    async def three_updates():
        await commit_and_apply([first, second], (0, 1))
        await asyncio.gather(apply_update(first, 2, members), apply_update(second, 3, members))
        assert first.syncs.pending is not None and second.syncs.pending is not None  # the sync's round, under way
        await asyncio.gather(apply_update(first, 4, members), apply_update(second, 5, members))

    asyncio.run(asyncio.wait_for(three_updates(), 120))
    assert tries == [True, True]
    assert first.epoch == second.epoch == 3
    assert first.digest() == second.digest(), "the members took different outer steps"
    expected = expected_after_sync(checkpoint)
    for ours, theirs, reference in zip(first.outer.anchors, second.outer.anchors, expected):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    assert not torch.equal(first.masters[0], first.outer.anchors[0])  # plus its own inner step of update 2


def test_a_member_says_when_the_trainers_commits_name_different_trainers(pair):
    """With local steps each trainer names the trainers it met at its rendezvous. Once every trainer named has
    committed and no set of them names the same trainers, no round can start: the member's status says so (`split`),
    and the trainers agree on who is in (client/training/update.py). A commit with the set agreed starts the round."""
    _, (first, _) = pair
    span = pb.Span(model="model", start=0, end=2)

    def commit(trainer: str, named: list[str], version: int = 1) -> pb.CommitRequest:
        holding = pb.Holding(peer_id=first.group.peer_id)
        return pb.CommitRequest(
            run_id="sync", span=span, epoch=0, version=version, trainer=trainer, trainers=named, members=[holding]
        )

    async def commits() -> list[pb.RoundStatus]:
        return [
            await first.commit(commit("A", ["A", "B"])),  # A met only B
            await first.commit(commit("B", ["A", "B", "C"])),
            await first.commit(commit("C", ["A", "B", "C"])),
            await first.commit(commit("A", ["A", "B", "C"], version=2)),  # agreed
        ]

    waiting, still_waiting, split, agreed = asyncio.run(asyncio.wait_for(commits(), 60))
    assert [s.state for s in (waiting, still_waiting, split)] == [pb.RoundStatus.WAITING] * 3
    assert not waiting.split and not still_waiting.split and split.split  # C might yet have named A and B only
    assert agreed.state == pb.RoundStatus.AVERAGED and list(agreed.trainers) == ["A", "B", "C"] and not agreed.split
