"""The outer step of local-steps runs (DiLoCo) against torch's SGD with Nesterov momentum."""

from __future__ import annotations

import pytest
import torch

from swarm.training.outer import OuterStep, sync_due


def test_syncs_come_after_every_hth_update_and_never_with_one():
    assert [e for e in range(9) if sync_due(e, 3)] == [2, 5, 8]
    assert not any(sync_due(e, 1) for e in range(9))


def test_the_outer_step_is_torchs_nesterov_sgd_on_the_pseudo_gradients():
    """Three syncs of H inner moves each: the weights equal torch.optim.SGD(nesterov=True) stepping the weights at
    the last sync with (those weights - the weights now) as the gradient."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator)]
    outer = OuterStep(params, lr=0.7, momentum=0.9)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        with torch.no_grad():
            for p in params:  # the inner steps: any move
                p.add_(torch.randn(p.shape, generator=generator) * 0.01)
        deltas = outer.pseudo_gradients()
        for r, d in zip(reference, deltas):
            r.grad = d.float()
        sgd.step()
        outer.apply(deltas)
        for p, r, anchor in zip(params, reference, outer.anchors):
            torch.testing.assert_close(p, r.detach(), atol=1e-6, rtol=0)
            assert torch.equal(p, anchor)  # the result is the next sync's starting point


def test_averaged_pseudo_gradients_bring_members_to_the_same_weights():
    """Two members from the same sync, apart after their inner steps, equal again after the sync."""
    start = [torch.ones(3)]
    members = [OuterStep([t.clone()], lr=0.7, momentum=0.9) for t in (start[0], start[0])]
    with torch.no_grad():
        members[0].params[0].add_(0.1)
        members[1].params[0].sub_(0.3)
    mean = [(a + b) / 2 for a, b in zip(members[0].pseudo_gradients(), members[1].pseudo_gradients())]
    for member in members:
        member.apply(mean)
    assert torch.equal(members[0].params[0], members[1].params[0])
    assert members[0].params[0][0].item() == pytest.approx(1 - 0.7 * (0.1 + 0.9 * 0.1))
    with pytest.raises(ValueError, match="2 pseudo-gradients for 1 parameters"):
        members[0].apply(mean * 2)


def test_an_overlapped_outer_step_lands_on_the_inner_steps_taken_since():
    """Streaming DiLoCo's overlap: two members take their pseudo-gradients, move on with another inner step each while
    the round runs, then land the averaged outer step. Their sync points equal the sync's without overlap, and each
    keeps the move it made meanwhile, which the next sync's pseudo-gradients hold."""
    start = torch.ones(3)
    members = [OuterStep([start.clone()], lr=0.7, momentum=0.9) for _ in range(2)]
    waited = OuterStep([start.clone()], lr=0.7, momentum=0.9)
    with torch.no_grad():
        members[0].params[0].add_(0.1)
        members[1].params[0].sub_(0.3)
        waited.params[0].sub_(0.1)  # the mean of the two moves
    taken = [member.take() for member in members]
    mean = [(a + b) / 2 for a, b in zip(*taken)]
    moves = (torch.tensor([0.01, 0.0, 0.0]), torch.tensor([0.0, -0.02, 0.0]))
    with torch.no_grad():
        for member, move in zip(members, moves):  # the inner steps taken while the round runs
            member.params[0].add_(move)
    for member in members:
        member.apply(mean, carry=True)
    waited.apply(waited.pseudo_gradients())
    for member, move in zip(members, moves):
        assert torch.equal(member.anchors[0], members[0].anchors[0])
        torch.testing.assert_close(member.anchors[0], waited.anchors[0], atol=1e-7, rtol=0)
        torch.testing.assert_close(member.momenta[0], waited.momenta[0], atol=1e-7, rtol=0)
        torch.testing.assert_close(member.params[0], waited.anchors[0] + move, atol=1e-7, rtol=0)
        torch.testing.assert_close(member.pseudo_gradients()[0], -move.double(), atol=1e-7, rtol=0)
        assert member.taken is None
    with pytest.raises(ValueError, match="needs the weights its pseudo-gradients were taken at"):
        members[0].apply(mean, carry=True)
