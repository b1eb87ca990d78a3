"""Training settings of peers and trainers: bad values get errors naming them."""

from __future__ import annotations

import pytest

from client.config import TrainConfig
from peer.config import PeerConfig
from peer.config import TrainingConfig


@pytest.mark.parametrize("kwargs, words", [
    (dict(batch_size=6, micro_batch_size=4), "multiple of micro_batch_size"),
    (dict(batch_size=0), "batch_size"),
    (dict(run_id="a.b"), "run id"),
    (dict(optimizer="lion"), "optimizer"),
    (dict(max_in_flight=-1), "max_in_flight"),
    (dict(step_timeout_s=0), "step_timeout_s"),
])
def test_trainer_settings(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="qlora"), "train mode"), (dict(target_batch_size=0), "target_batch_size"),
    (dict(lr=-1.0), "lr"), (dict(run_id=""), "run id"), (dict(save_every=-1), "save_every"),
])
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
