"""Training settings of peers and trainers: bad values get errors naming them."""

from __future__ import annotations

import pytest

from client.config import TrainConfig
from peer.config import PeerConfig, TrainingConfig
from protocol.records import CLOCK_SKEW_S, MAX_RECORD_TTL_S, max_update_period_s, record_ttl_s


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(batch_size=6, micro_batch_size=4), "multiple of micro_batch_size"),
        (dict(batch_size=0), "batch_size"),
        (dict(run_id="a.b"), "run id"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(max_in_flight=-1), "max_in_flight"),
        (dict(step_timeout_s=0), "step_timeout_s"),
    ],
)
def test_trainer_settings(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(mode="qlora"), "train mode"),
        (dict(target_batch_size=0), "target_batch_size"),
        (dict(lr=-1.0), "lr"),
        (dict(run_id=""), "run id"),
        (dict(save_every=-1), "save_every"),
    ],
)
def test_peer_training_settings(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TrainingConfig(**kwargs)


def test_a_training_peer_needs_fixed_blocks():
    with pytest.raises(ValueError, match="--blocks"):
        PeerConfig(model="m", training=TrainingConfig())
    assert PeerConfig(model="m", blocks=(0, 2), training=TrainingConfig()).training.run_id == "default"


@pytest.mark.parametrize("value", ["a b", "host:port", ":80", "h:123456"])
def test_announce_host_is_checked(value):
    with pytest.raises(ValueError, match="announce_host"):
        PeerConfig(model="m", announce_host=value)


def test_a_peer_announces_only_within_the_record_lifetime_the_dht_accepts():
    # records live 2 * period + 5 s; the DHT refuses ours beyond MAX_RECORD_TTL_S, with room for clock skew
    assert record_ttl_s(max_update_period_s()) == MAX_RECORD_TTL_S - CLOCK_SKEW_S
    PeerConfig(model="m", update_period_s=max_update_period_s())
    with pytest.raises(ValueError, match=r"update_period_s must be at most 117.5 s, got 200"):
        PeerConfig(model="m", update_period_s=200)


@pytest.mark.parametrize("value", [-1.0, 2e7])
def test_an_announced_throughput_is_capped(value):
    with pytest.raises(ValueError, match="throughput must be in"):
        PeerConfig(model="m", throughput=value)
