"""Spot checks (client/verify.py): the tolerance rule, the vote (two against one outvotes, three against one bans),
and recomputing a span's route.

The vote runs against recompute functions that return chosen answers (what other routes would have computed),
and bans through a real BanList.
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch

from client.config import ClientConfig
from client.routing import RouteHop
from client.sequence import BanList, RemoteSequence
from client.verify import WRONG_RESULT_BAN_S, Computed, SpotChecker, agree, backward_on, forward_on, rtol_for

SPAN = (0, 4)


def _hidden(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed))


def _perturbed(tensor: torch.Tensor, scale: float = 1e-2, seed: int = 1) -> torch.Tensor:
    noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed))
    return tensor + scale * tensor.std() * noise


def test_answers_agree_within_the_dtype_tolerance_of_their_largest_magnitude():
    hidden = _hidden()
    assert agree(hidden, hidden.clone(), rtol_for(torch.float32))
    assert agree(hidden, hidden + 1e-6 * hidden.abs().max(), rtol_for(torch.float32))  # a sum in another order
    assert not agree(hidden, _perturbed(hidden), rtol_for(torch.float32))  # the test liar's noise
    # the same relative lie on tiny gradients is caught too: no absolute term hides it
    tiny = _hidden(scale=1e-9)
    assert not agree(tiny, _perturbed(tiny), rtol_for(torch.float32))
    assert agree(torch.zeros(3), torch.zeros(3), rtol_for(torch.float32))
    # half precision is looser, and the loosest dtype of a comparison decides
    assert rtol_for(torch.float32) < rtol_for(torch.float16) < rtol_for(torch.bfloat16)
    assert rtol_for(torch.float32, torch.bfloat16) == rtol_for(torch.bfloat16)
    rounded = hidden.to(torch.bfloat16).float()
    assert agree(hidden, rounded, rtol_for(torch.bfloat16)) and not agree(hidden, rounded, rtol_for(torch.float32))


def test_an_outlier_feature_hides_no_lie_on_the_other_elements():
    """Hidden states carry a few features ~100x the rest: a tolerance relative to the tensor's largest magnitude
    would let every other element be off by 1e-4 of that outlier. Per element, each row's typical magnitude sets it."""
    hidden = _hidden()
    hidden[..., 3] = 1e4  # an outlier feature in every row
    lie = hidden.clone()
    lie[0, 2, 7] += 0.05  # one element of one row, off by a few percent of its row's magnitude (~0.8)
    assert not agree(hidden, lie, rtol_for(torch.float32))
    assert agree(hidden, hidden * (1 + 1e-6), rtol_for(torch.float32))  # honest rounding still passes
    assert not agree(hidden, hidden[:, :-1], rtol_for(torch.float32))  # another shape never agrees


class Swarm:
    """What other routes compute: peer ids in order of preference, each with its answer."""

    def __init__(self, answers: dict[str, torch.Tensor]):
        self.answers, self.asked = answers, []

    async def recompute(self, excluded: frozenset[str]) -> Computed | None:
        self.asked.append(excluded)
        for peer, value in self.answers.items():
            if peer not in excluded:
                return Computed(value, (peer,))
        return None


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _checker() -> tuple[SpotChecker, BanList]:
    bans = BanList(base_s=1.0, clock=Clock())
    return SpotChecker(1.0, bans.ban, random.Random(0)), bans


def _check(checker: SpotChecker, first: Computed, swarm: Swarm) -> Computed:
    return asyncio.run(checker.check("forward", SPAN, first, swarm.recompute))


def test_honest_peers_agree_and_the_first_answer_is_used_unchanged():
    checker, bans = _checker()
    hidden = _hidden()
    first = Computed(hidden, ("a",))
    swarm = Swarm({"a": hidden, "b": hidden + 1e-7})
    assert _check(checker, first, swarm) is first
    assert swarm.asked == [{"a"}], "the check must avoid the first peer, and need no tie-break"
    assert (checker.stats.verified, checker.stats.mismatches, checker.stats.unverifiable) == (1, 0, 0)
    assert bans.banned() == set()


def test_a_span_nobody_else_serves_is_unverifiable():
    checker, bans = _checker()
    first = Computed(_hidden(), ("a",))
    assert _check(checker, first, Swarm({})) is first
    assert (checker.stats.verified, checker.stats.unverifiable) == (0, 1)
    assert bans.banned() == set()


def test_the_first_peer_outvoted_three_to_one_is_banned_long_and_the_majority_answer_used(caplog):
    checker, bans = _checker()
    honest = _hidden()
    swarm = Swarm({"b": honest, "c": honest.clone(), "d": honest.clone()})
    with caplog.at_level(logging.WARNING, logger="client.verify"):
        chosen = _check(checker, Computed(_perturbed(honest), ("a",)), swarm)
    assert chosen.peers == ("b",) and torch.equal(chosen.value, honest)
    assert swarm.asked == [{"a"}, {"a", "b"}, {"a", "b", "c"}], "each new route must avoid every peer asked so far"
    assert bans.banned() == {"a"} and checker.stats.caught == ["a"] and checker.stats.outvoted == []
    bans.clock.now += WRONG_RESULT_BAN_S - 1
    assert bans.banned() == {"a"}, "a wrong result must cost more than a failure's ban"
    assert (checker.stats.verified, checker.stats.mismatches, checker.stats.unresolved) == (1, 1, 0)
    warning = " ".join(record.getMessage() for record in caplog.records)
    assert all(peer in warning for peer in "abcd") and "max |difference|" in warning


def test_outvoted_two_to_one_with_no_fourth_peer_the_majority_answer_is_used_but_nobody_banned(caplog):
    checker, bans = _checker()
    honest = _hidden()
    swarm = Swarm({"b": honest, "c": honest.clone()})
    with caplog.at_level(logging.WARNING, logger="client.verify"):
        chosen = _check(checker, Computed(_perturbed(honest), ("a",)), swarm)
    assert chosen.peers == ("b",) and torch.equal(chosen.value, honest)
    assert swarm.asked == [{"a"}, {"a", "b"}, {"a", "b", "c"}]
    assert bans.banned() == set() and checker.stats.caught == [] and checker.stats.outvoted == ["a"]
    assert "no fourth peer" in caplog.text and "not banned" in caplog.text


def test_two_colluding_checkers_never_get_an_honest_peer_banned():
    """Two liars that tell the same lie, drawn as both checkers: two against one, but a fourth (honest) peer sides
    with the first, and without one the first is only set aside. Its answer is kept when the fourth backs it."""
    honest = _hidden()
    lie = _perturbed(honest)
    checker, bans = _checker()
    first = Computed(honest, ("a",))
    assert _check(checker, first, Swarm({"b": lie, "c": lie.clone(), "d": honest.clone()})) is first
    assert bans.banned() == set() and checker.stats.unresolved == 1 and checker.stats.outvoted == []
    checker, bans = _checker()
    assert _check(checker, first, Swarm({"b": lie, "c": lie.clone()})).peers == ("b",)
    assert bans.banned() == set() and checker.stats.outvoted == ["a"]


def test_a_fourth_answer_that_agrees_with_nobody_confirms_nothing():
    checker, bans = _checker()
    honest = _hidden()
    swarm = Swarm({"b": honest, "c": honest.clone(), "d": _perturbed(honest, seed=5)})
    assert _check(checker, Computed(_perturbed(honest), ("a",)), swarm).peers == ("b",)
    assert bans.banned() == set() and checker.stats.outvoted == ["a"] and checker.stats.caught == []


def test_a_lying_checker_is_banned_three_to_one_and_the_first_answer_kept():
    checker, bans = _checker()
    honest = _hidden()
    first = Computed(honest, ("a",))
    assert _check(checker, first, Swarm({"b": _perturbed(honest), "c": honest.clone(), "d": honest.clone()})) is first
    assert bans.banned() == {"b"} and checker.stats.caught == ["b"]
    checker, bans = _checker()
    assert _check(checker, first, Swarm({"b": _perturbed(honest), "c": honest.clone()})) is first
    assert bans.banned() == set() and checker.stats.outvoted == ["b"]


def test_without_a_third_peer_nobody_is_banned_and_the_first_answer_kept(caplog):
    checker, bans = _checker()
    honest = _hidden()
    first = Computed(honest, ("a",))
    with caplog.at_level(logging.WARNING, logger="client.verify"):
        assert _check(checker, first, Swarm({"b": _perturbed(honest)})) is first
    assert bans.banned() == set() and checker.stats.caught == []
    assert (checker.stats.mismatches, checker.stats.unresolved) == (1, 1)
    assert "no third peer" in caplog.text and "a" in caplog.text and "b" in caplog.text


def test_three_different_answers_ban_nobody():
    checker, bans = _checker()
    honest = _hidden()
    first = Computed(honest, ("a",))
    swarm = Swarm({"b": _perturbed(honest, seed=2), "c": _perturbed(honest, seed=3)})
    assert _check(checker, first, swarm) is first
    assert bans.banned() == set() and checker.stats.unresolved == 1


def test_an_outvoted_route_of_several_peers_is_not_banned():
    """Which of them lied is not known: banning them all could ban honest peers."""
    checker, bans = _checker()
    honest = _hidden()
    first = Computed(honest, ("a",))

    async def recompute(excluded):
        return Computed(_perturbed(honest), ("b", "d")) if "b" not in excluded else Computed(honest, ("c",))

    assert asyncio.run(checker.check("forward", SPAN, first, recompute)) is first
    assert bans.banned() == set() and checker.stats.mismatches == 1 and checker.stats.unresolved == 0


def test_draws_follow_the_fraction_and_repeat_with_the_seed():
    assert not any(SpotChecker(0.0, BanList(1.0).ban).draw() for _ in range(100))
    assert all(SpotChecker(1.0, BanList(1.0).ban).draw() for _ in range(100))
    runs = [SpotChecker(0.3, BanList(1.0).ban, random.Random(7)) for _ in range(2)]
    draws = [[checker.draw() for _ in range(2000)] for checker in runs]
    assert draws[0] == draws[1] and 500 < sum(draws[0]) < 700
    with pytest.raises(ValueError, match="verify_fraction"):
        SpotChecker(1.5, BanList(1.0).ban)
    with pytest.raises(ValueError, match="verify_fraction"):
        ClientConfig(initial_peers=("/ip4/127.0.0.1/tcp/1",), verify_fraction=-0.1)


def test_hops_of_training_runs_are_not_checked():
    """A stage's peers change their weights as the run goes: two of them agree only at the same epoch."""
    config = ClientConfig(initial_peers=("/ip4/127.0.0.1/tcp/1",), verify_fraction=1.0)
    assert ClientConfig(initial_peers=config.initial_peers).verify_fraction == 0.05
    sequence = RemoteSequence(None, "model", 2, config)  # no DHT: nothing is sent
    assert sequence._draw_check()
    sequence.run_id = "run"  # as SwarmTrainer sets it
    assert not sequence._draw_check()


def test_a_wrong_result_ban_lasts_at_least_what_it_asks():
    clock = Clock()
    bans = BanList(base_s=1.0, clock=clock)
    assert bans.ban("a", 100.0) == 100.0
    assert bans.ban("b") == 1.0 and bans.ban("b", 0.5) == 2.0  # strikes still count


# --- recomputing a span on a route of several hops ---

BLOCKS = [torch.nn.Linear(16, 16) for _ in range(4)]
for _i, _block in enumerate(BLOCKS):
    torch.nn.init.normal_(_block.weight, std=0.3, generator=torch.Generator().manual_seed(_i))


def _run(hop: RouteHop, hidden: torch.Tensor) -> torch.Tensor:
    for block in BLOCKS[hop.start : hop.end]:
        hidden = torch.tanh(block(hidden))
    return hidden


async def _forward(hop, hidden):
    with torch.no_grad():
        return _run(hop, hidden)


async def _backward(hop, hidden, grad):
    hidden = hidden.clone().requires_grad_(True)
    _run(hop, hidden).backward(grad)
    return hidden.grad


async def _failing(hop, *args):
    return None


ROUTE = [RouteHop("b", 0, 1, "b:1"), RouteHop("c", 1, 3, "c:1"), RouteHop("d", 3, 4, "d:1")]


def test_a_route_of_several_hops_recomputes_the_spans_output_and_gradient():
    inputs, grad = _hidden(4), _hidden(5)
    whole = RouteHop("a", 0, 4, "a:1")
    output, sent = asyncio.run(forward_on(ROUTE, inputs, _forward))
    torch.testing.assert_close(output, asyncio.run(_forward(whole, inputs)))
    assert [hop for hop, _ in sent] == ROUTE and sent[0][1] is inputs
    torch.testing.assert_close(sent[2][1], asyncio.run(_forward(RouteHop("x", 0, 3, ""), inputs)))
    got = asyncio.run(backward_on(ROUTE, inputs, grad, _forward, _backward))
    torch.testing.assert_close(got, asyncio.run(_backward(whole, inputs, grad)))
    assert asyncio.run(forward_on(ROUTE, inputs, _failing)) is None
    assert asyncio.run(backward_on(ROUTE, inputs, grad, _forward, _failing)) is None
