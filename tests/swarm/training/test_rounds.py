"""swarm.training.rounds against real hivemind DHT nodes and averager processes on 127.0.0.1: a round among the members
a commit names averages exactly, and a round that misses anything says so instead of handing out a partial average.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.training.allreduce import RoundRunner
from swarm.training.recipe import AVERAGING_COMPRESSIONS
from swarm.training.rounds import COMPRESSIONS, RoundAverager, RoundResult, RoundSettings

SETTINGS = RoundSettings(sender_timeout_s=4.0, part_size_bytes=1 << 14)
PREFIX = "test_rounds"
SHAPES = [(64, 33), (17,)]


def member_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64, generator=generator) for shape in SHAPES]


@contextlib.contextmanager
def starting():
    """start(count) -> DHT nodes with an averager each; everything is stopped at the end, also on failure."""
    dhts, averagers = [], []

    def start(count: int, averager_type=RoundAverager, shapes=SHAPES, settings=SETTINGS) -> list[RoundAverager]:
        started = []
        for _ in range(count):
            dhts.append(start_dht(visible_maddrs(dhts[0]) if dhts else ()))
            tensors = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
            averagers.append(averager_type(tensors, dhts[-1], prefix=PREFIX, settings=settings))
            started.append(averagers[-1])
        return started

    try:
        yield start
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            stop_dht(dht)


@pytest.fixture
def swarm():
    """Averagers of a test's own (other settings or types, or one that is killed)."""
    with starting() as start:
        yield start


@pytest.fixture(scope="module")
def plain():
    """Four plain averagers that the tests of ordinary rounds share: each test's rounds have ids of their own,
    and starting DHT nodes and averager processes is most of these tests' time."""
    with starting() as start:
        yield start(4)


def run_round(
    averagers: Sequence[RoundAverager],
    members: Sequence[str],
    round_id: bytes,
    timeout_s: float = 20.0,
    seeds: Sequence[int] | None = None,
) -> dict[str, RoundResult]:
    """Each averager enters the round from a thread of its own, as members do when their commit arrives."""
    results: dict[str, RoundResult] = {}
    seeds = seeds or range(len(averagers))

    def enter(averager: RoundAverager, seed: int) -> None:
        results[averager.member_id] = averager.average(
            member_tensors(seed), round_id=round_id, members=members, timeout_s=timeout_s
        )

    threads = [threading.Thread(target=enter, args=(a, s), daemon=True) for a, s in zip(averagers, seeds)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    assert not any(thread.is_alive() for thread in threads), "average() did not return"
    return results


def mean_of(seeds: Sequence[int]) -> list[torch.Tensor]:
    tensors = [member_tensors(seed) for seed in seeds]
    return [sum(parts) / len(seeds) for parts in zip(*tensors)]


def assert_exact_mean(result: RoundResult, expected: list[torch.Tensor]) -> None:
    assert result.complete and not result.reason, result.reason
    for got, want in zip(result.tensors, expected):
        assert got.dtype == torch.float64
        # float64 throughout: a float32 sum anywhere would be ~1e-8 off
        torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_three_members_average_exactly_and_identically(plain):
    averagers = plain[:3]
    members = [a.member_id for a in averagers]
    results = run_round(averagers, members, b"round-1")
    expected = mean_of(range(3))
    for result in results.values():
        assert_exact_mean(result, expected)
        assert result.members == tuple(sorted(members))
    # bit for bit: members compare digests of the result, and a mean over three has every bit of float64
    first, *others = results.values()
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first.tensors, other.tensors))

    # the next round, among two of them: a new group, the third's tensors play no part
    results = run_round(averagers[:2], members[:2], b"round-2")
    for result in results.values():
        assert_exact_mean(result, mean_of(range(2)))


def test_float16_rounds_send_a_quarter_of_the_bytes_and_every_member_ends_identical(swarm, plain):
    """Compressed, each member's parts and each reducer's answers lose precision, but the same everywhere: the
    members compare digests of what they averaged, so a member-specific rounding would split every round."""
    exact = run_round(plain[:3], [a.member_id for a in plain[:3]], b"exact")
    compressed = swarm(3, settings=dataclasses.replace(SETTINGS, compression="float16"))
    results = run_round(compressed, [a.member_id for a in compressed], b"float16")
    expected = mean_of(range(3))
    first, *others = results.values()
    assert first.complete and all(other.complete for other in others), [r.reason for r in results.values()]
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first.tensors, other.tensors))
    for got, want in zip(first.tensors, expected):
        assert got.dtype == torch.float64
        assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())  # float16 of scaled parts
        assert not torch.equal(got, want)  # lossy: it did compress
    # what all members sent together (each sends the parts the others reduce: shares differ, their sum does not)
    sent = [sum(r.sent_bytes for r in run.values()) for run in (results, exact)]
    assert sent[1] == 2 * sum(t.numel() for t in expected) * 8  # float64: every value but its share, by each member
    assert 0 < sent[0] <= sent[1] / 3.9, sent  # float16, and each part's mean and deviation


def test_int8_rounds_send_an_eighth_of_the_bytes_feed_back_what_they_lost_and_every_member_ends_identical(swarm):
    """The same gradients averaged again and again: with error feedback the mean over rounds closes in on the exact
    average (each round's loss is fed into the next), without it the same rounding repeats every round."""
    int8 = dataclasses.replace(SETTINGS, compression="int8")
    averagers = swarm(3, settings=int8)
    members = [a.member_id for a in averagers]
    expected = mean_of(range(3))
    scale = max(float(t.abs().max()) for t in expected)
    rounds = []
    for i in range(6):
        results = run_round(averagers, members, f"int8-{i}".encode())
        first, *others = results.values()
        assert first.complete and all(other.complete for other in others), [r.reason for r in results.values()]
        for other in others:
            assert all(torch.equal(a, b) for a, b in zip(first.tensors, other.tensors))
        rounds.append(first.tensors)
        if i == 0:
            sent = sum(r.sent_bytes for r in results.values())
            exact = 2 * sum(t.numel() for t in expected) * 8
            assert 0 < sent <= exact / 7, (sent, exact)  # 64 codes and a float32 scale per 64 float64 values, padded

    def error(tensors) -> float:
        return max(float((got - want).abs().max()) for got, want in zip(tensors, expected)) / scale

    once = error(rounds[0])
    assert 0 < once < 2e-2  # one rounding of each member's parts and of the average
    mean = [sum(parts) / len(rounds) for parts in zip(*rounds)]
    # the losses cancel (without feedback every round would send the same bytes: the mean no better than one)
    assert error(mean) < once / 4, (error(mean), once)


def test_a_round_of_one_returns_its_own_tensors_at_once(plain):
    averager = plain[3]
    tensors = member_tensors(7)
    result = averager.average(tensors, round_id=b"alone", members=[averager.member_id], timeout_s=5)
    assert result.complete and result.seconds == 0.0
    assert all(torch.equal(a, b) for a, b in zip(result.tensors, tensors))
    with pytest.raises(ValueError, match="do not include this member"):
        averager.average(tensors, round_id=b"x", members=["QmNotMe"], timeout_s=5)
    with pytest.raises(ValueError, match="are not"):
        averager.average([t.float() for t in tensors], round_id=b"x", members=[averager.member_id], timeout_s=5)


def test_a_listed_member_that_never_joins_makes_the_round_incomplete(plain):
    averagers = plain[:3]
    members = [a.member_id for a in averagers]
    results = run_round(averagers[:2], members, b"round-absent", timeout_s=15.0)
    absent = averagers[2].member_id
    for result in results.values():
        assert not result.complete and result.tensors is None
        assert absent in result.reason, result.reason
        assert result.seconds < 15.0  # the others left it out after the sender timeout, not the round's


def test_a_round_a_later_attempt_replaced_ends_at_once_and_the_next_one_meets(plain):
    """A member waits in attempt v1 of a round whose partner moved on to the next attempt. One round runs at a time,
    so without abandoning v1 the member would enter v2 only at v1's timeout (60 s here), after its partner gave up
    on v2: members one attempt apart would never meet. Abandoned, v1 ends at once and both meet in v2."""
    a, b = plain[:2]
    members = [a.member_id, b.member_id]
    old: dict[str, RoundResult] = {}

    def wait_in_v1() -> None:
        old["v1"] = a.average(member_tensors(0), round_id=b"v1", members=members, timeout_s=60.0)

    thread = threading.Thread(target=wait_in_v1, daemon=True)
    thread.start()
    time.sleep(1.0)  # in the round, waiting for b
    a.abandon(b"v1")
    thread.join(20)
    assert not thread.is_alive(), "the abandoned round held on"
    assert not old["v1"].complete and "abandoned" in old["v1"].reason
    for result in run_round([a, b], members, b"v2").values():
        assert_exact_mean(result, mean_of([0, 1]))
    # one abandoned before it started does not start at all
    a.abandon(b"v3")
    late = a.average(member_tensors(0), round_id=b"v3", members=members, timeout_s=60.0)
    assert not late.complete and "abandoned" in late.reason and late.seconds == 0.0


class _Heavy(RoundRunner):
    """A listed member that puts a huge weight on the parts it sends."""

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            message.weight = 1e30
            yield message


# hivemind names a call's handler after the servicer's class: a member's averager must be called RoundAverager
HeavyAverager = type("RoundAverager", (RoundAverager,), {"_runner_type": _Heavy})


def test_a_member_cannot_weigh_itself_up(swarm):
    averagers = [*swarm(2), *swarm(1, averager_type=HeavyAverager)]
    members = [a.member_id for a in averagers]
    results = run_round(averagers, members, b"round-heavy")
    for result in results.values():
        assert_exact_mean(result, mean_of(range(3)))


def test_a_stranger_that_is_not_listed_cannot_contribute(plain):
    averagers = plain
    members = [a.member_id for a in averagers[:3]]
    stranger = averagers[3]
    results: dict[str, RoundResult] = {}
    # the stranger enters the same round, listing itself, and sends its parts to every member
    intruding = threading.Thread(
        target=lambda: results.__setitem__(
            "stranger",
            stranger.average(
                member_tensors(99), round_id=b"round-s", members=[*members, stranger.member_id], timeout_s=15.0
            ),
        ),
        daemon=True,
    )
    intruding.start()
    results |= run_round(averagers[:3], members, b"round-s")
    intruding.join(45)
    for member in members:
        assert_exact_mean(results[member], mean_of(range(3)))
    assert not results["stranger"].complete


class _Stalling(RoundRunner):
    """A member that sends two parts to each reducer, then stalls: it is still in the round when it is killed."""

    async def _generate_input_for_peer(self, peer_index: int):
        sent = 0
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            sent += 1
            if sent == 2:
                await asyncio.sleep(60)


StallingAverager = type("RoundAverager", (RoundAverager,), {"_runner_type": _Stalling})


def test_a_member_that_dies_mid_round_leaves_the_others_incomplete(swarm):
    shapes = [(1 << 16,)]  # 32 parts of 16 KiB: a dozen for each reducer
    averagers = [*swarm(2, shapes=shapes), *swarm(1, averager_type=StallingAverager, shapes=shapes)]
    members = [a.member_id for a in averagers]
    victim = averagers[2]
    results: dict[str, RoundResult] = {}

    def enter(averager: RoundAverager, seed: int) -> None:
        tensors = [torch.randn(shapes[0], dtype=torch.float64, generator=torch.Generator().manual_seed(seed))]
        results[averager.member_id] = averager.average(tensors, round_id=b"round-kill", members=members, timeout_s=30.0)

    threads = [threading.Thread(target=enter, args=(a, i), daemon=True) for i, a in enumerate(averagers)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert not results, "the round ended before the member could die in it"
    os.kill(victim.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    for member in members[:2]:
        result = results[member]
        assert not result.complete and result.tensors is None, "a partial average was handed out as complete"
        assert victim.member_id in result.reason, result.reason
    assert not results[victim.member_id].complete


def test_every_compression_a_recipe_names_has_a_codec():
    assert set(COMPRESSIONS) == set(AVERAGING_COMPRESSIONS)
