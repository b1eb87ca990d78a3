"""swarm.training.averaging against real hivemind DHT nodes and averager processes: rounds that cannot hang, and who is
expected in a round."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.dht.node import start_dht, stop_dht, visible_maddrs
from swarm.training.averaging import TrainingGroup, group_key
from swarm.training.optim import make_optimizer
from swarm.training.recipe import RunRecipe
from swarm.training.settings import AveragingSettings

SETTINGS = AveragingSettings(matchmaking_time_s=0.5, averaging_timeout_s=6.0, load_state_timeout_s=2.0)


def make_group(dht, **kwargs) -> TrainingGroup:
    params = [torch.nn.Parameter(torch.ones(3, 2))]
    return TrainingGroup(
        dht,
        group_key("test-model", "run", "trainers"),
        params,
        make_optimizer(RunRecipe(optimizer="adamw", lr=1e-2), params),
        settings=SETTINGS,
        **kwargs,
    )


@pytest.fixture
def dhts():
    started = []

    def start(count: int):
        for _ in range(count):
            started.append(start_dht(visible_maddrs(started[0]) if started else ()))
        return started

    yield start
    for dht in started:
        stop_dht(dht)


def test_a_round_whose_averager_died_fails_instead_of_hanging(dhts):
    [dht] = dhts(1)
    group = make_group(dht)
    try:
        group.averager.kill()  # as if it crashed: hivemind's step would wait on it forever
        group.averager.join(10)
        results = []
        caller = threading.Thread(
            target=lambda: results.append(group.average([torch.ones(3, 2)], 4, members=2)), daemon=True
        )
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "average() hung on a dead averager"
        grads, state, epoch = results[0]
        assert torch.equal(grads[0], torch.ones(3, 2)) and state is None and epoch == 1
        assert group.failed_rounds == 1
    finally:
        group.shutdown()


def test_shutdown_releases_a_round_that_is_looking_for_its_group(dhts):
    [dht] = dhts(1)
    group = make_group(dht)
    results = []
    caller = threading.Thread(
        target=lambda: results.append(group.average([torch.ones(3, 2)], 4, members=2)), daemon=True
    )
    caller.start()
    time.sleep(0.5)  # looking for a second member that never comes
    began = time.monotonic()
    group.shutdown()
    caller.join(10)
    assert not caller.is_alive() and results and results[0][1] is None
    assert time.monotonic() - began < SETTINGS.averaging_timeout_s


def test_a_member_is_expected_while_its_progress_record_lives(dhts):
    first_dht, second_dht = dhts(2)
    first, second = make_group(first_dht), make_group(second_dht, progress_ttl_s=5.0)
    try:
        deadline = time.monotonic() + 20
        while first.expected_members() < 2:  # the second member's first publish
            assert time.monotonic() < deadline, "the second member's progress never showed up"
            time.sleep(0.2)
        first.epoch = 1  # a publish behind: still expected
        assert first.expected_members() == 2
        first.epoch = 2  # two updates behind: it left the run or lost track, and is not waited for
        assert first.expected_members() == 1
        first.epoch = 1
        stopped = time.monotonic()
        second.shutdown()  # stops publishing: a short record would lapse after 4 periods (2 s), this one lives on
        time.sleep(4 * SETTINGS.progress_period_s + 1)
        assert first.expected_members() == 2
        time.sleep(max(0.0, stopped + 5.0 + 1.0 - time.monotonic()))
        assert first.expected_members() == 1
    finally:
        first.shutdown()
        second.shutdown()
