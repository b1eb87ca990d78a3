"""A training peer of a run with local steps (DiLoCo): what it vouches for, and its inner and outer steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peer.blocks import load_span
from peer.config import TrainingConfig
from peer.training.follow import Follower
from peer.training.span import SpanTraining
from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError
from swarm.models.checkpoint import load_config
from swarm.training.recipe import RunRecipe
from tests.helpers.models import make_tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"), num_layers=2, seed=3)


def member(path, local_steps: int, sync_overlap: int = 0) -> SpanTraining:
    span = load_span(path, load_config(path), 0, 2, dtype=torch.float32, device=torch.device("cpu"))
    recipe = RunRecipe(lr=1e-2, local_steps=local_steps, sync_overlap=sync_overlap)
    return SpanTraining(span, TrainingConfig(run_id="diloco"), recipe, "model")


def own_gradients(training: SpanTraining, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(m.shape, generator=generator) for m in training.masters]


def test_members_apart_between_syncs_vouch_for_the_same_state(checkpoint):
    """Two members of a local-steps run take inner steps on different gradients: their weights differ, yet they
    announce one digest (of the weights at the last sync and the outer momentum), which a copy of either's whole
    state matches. A synchronous run's members vouch for everything."""
    first, second = member(checkpoint, 4), member(checkpoint, 4)
    status = pb.RoundStatus(epoch=0, state=pb.RoundStatus.AVERAGED)
    first._apply(own_gradients(first, 0), 1.0, status)
    second._apply(own_gradients(second, 1), 1.0, status)
    assert first.epoch == second.epoch == 1
    assert not torch.equal(first.masters[0], second.masters[0])
    assert first.digest() == second.digest()
    assert first.vouched(second.shared_state()[1]) == first.digest()
    # the span computes with the inner step's weights
    name, param = next(iter(sorted(first.span.layers.named_parameters())))
    assert torch.equal(param, first.masters[0]), name

    synchronous = [member(checkpoint, 1), member(checkpoint, 1)]
    for training, seed in zip(synchronous, (0, 1)):
        training._apply(own_gradients(training, seed), 1.0, status)
    assert synchronous[0].digest() != synchronous[1].digest()


def test_a_member_that_held_no_micro_batch_keeps_its_weights_and_moves_on(checkpoint):
    training = member(checkpoint, 4)
    before = [m.detach().clone() for m in training.masters]
    training._apply(None, 1.0, pb.RoundStatus(epoch=0, state=pb.RoundStatus.AVERAGED))
    assert training.epoch == 1
    assert all(torch.equal(m, b) for m, b in zip(training.masters, before))


def test_a_member_apart_from_the_majority_at_its_own_update_copies_it_only_with_local_steps(checkpoint):
    """A sync that failed for one member only leaves it with other weights at the last sync: it copies the state a
    majority vouches for at the same update, once it holds no micro-batch of it. A synchronous member does not
    (there, a majority at its own update with another digest is a round still being applied)."""
    local, synchronous = member(checkpoint, 4), member(checkpoint, 1)
    for training in (local, synchronous):
        mine = training.digest()
        assert not Follower(training).behind((0, mine))
        assert Follower(training).behind((0, "another state")) is (training is local)
    local.accumulators.add("trainer", 0, 1, own_gradients(local, 0))
    assert not Follower(local).behind((0, "another state"))  # copying now would drop that micro-batch


def test_a_gradient_far_above_the_runs_median_is_refused_with_what_to_do(checkpoint):
    """After a warm-up, a micro-batch's gradient over 100x the median norm of those accepted is refused (one sender
    must not own an update); a run that diverges gets this for every micro-batch, so the message says what to do."""
    training = member(checkpoint, 4)
    usual = own_gradients(training, 0)
    for _ in range(8):
        training._check_norm(usual, 2)
    training._check_norm([g * 50 for g in usual], 2)  # large, not an outlier
    with pytest.raises(BadRequestError, match=r"over 100x the run's median .*lower --lr .*--outer-momentum"):
        training._check_norm([g * 500 for g in usual], 2)


async def _compute(fn):
    return fn()


def test_an_overlapped_sync_lands_its_outer_step_one_update_later_on_top_of_it(checkpoint):
    """A lone member with --local-steps 2 --sync-overlap 1 against one that waits for its syncs, on the same
    gradients: after the sync of update 1 the overlapped one's sync point has not moved yet, and it computes update
    2 with its inner steps alone; after update 2 its outer step has landed under that inner step, and the two hold
    the same weights and sync points (AdamW without decay steps by the gradients alone, wherever the weights are).
    Meanwhile it serves no copy of its state."""
    overlapped, waited = member(checkpoint, 2, sync_overlap=1), member(checkpoint, 2)
    anchors = [m.detach().clone() for m in overlapped.masters]

    async def train() -> None:  # one event loop, as a peer's: the sync's round runs on it between updates
        nonlocal anchors
        for epoch in range(5):
            for training in (overlapped, waited):
                status = pb.RoundStatus(epoch=epoch, state=pb.RoundStatus.AVERAGED)
                await training._apply_local_steps(own_gradients(training, epoch), 1.0, status, _compute)
            assert overlapped.epoch == waited.epoch == epoch + 1
            if epoch in (1, 3):  # the sync was taken; its step lands after the next update
                assert overlapped.syncs.pending is not None and overlapped.syncs.pending.lands == epoch + 1
                assert all(torch.equal(a, s) for a, s in zip(overlapped.outer.anchors, anchors))
                assert not torch.equal(waited.masters[0], overlapped.masters[0])
                # a joiner's copy now would miss the outer step: it is asked to come back after it landed
                with pytest.raises(RuntimeError, match=f"a sync lands after update {epoch + 1}; ask again then"):
                    overlapped.shared_state()
            else:
                assert overlapped.syncs.pending is None and overlapped.outer.taken is None
                assert overlapped.shared_state()[0] == epoch + 1
                for mine, theirs in zip(overlapped.state(), waited.state()):
                    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
                anchors = [a.clone() for a in overlapped.outer.anchors]

    asyncio.run(train())
    # the span computes with the landed weights
    name, param = next(iter(sorted(overlapped.span.layers.named_parameters())))
    assert torch.equal(param, overlapped.masters[0]), name
