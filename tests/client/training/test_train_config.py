"""Training settings of peers and trainers: bad values get errors naming them, and the settings of the run's recipe
are None unless given, so that a process knows what to adopt from the run."""

from __future__ import annotations

import pytest

from client.config import TrainConfig
from client.training.cli import build_parser, config_from_args
from peer.config import PeerConfig, TrainingConfig
from protocol.records import CLOCK_SKEW_S, MAX_RECORD_TTL_S, max_update_period_s, record_ttl_s
from protocol.vocab import TrainMode
from swarm.training.recipe import LRSchedule, RunRecipe


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(batch_size=6, micro_batch_size=4), "multiple of micro_batch_size"),
        (dict(batch_size=0), "batch_size"),
        (dict(run_id="a.b"), "run id"),
        (dict(optimizer="lion"), "optimizer"),
        (dict(max_in_flight=-1), "max_in_flight"),
        (dict(step_timeout_s=0), "step_timeout_s"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(router_aux_loss_coef=float("nan")), "router_aux_loss_coef"),
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


def test_recipe_settings_are_none_unless_given_and_overrides_say_what_was_given():
    assert TrainConfig().recipe_overrides() == {} and TrainingConfig().recipe_overrides() == {}
    assert TrainConfig(batch_size=4, micro_batch_size=2).recipe() == RunRecipe(batch_size=4)  # alone, the run's batch
    assert TrainingConfig().recipe() == RunRecipe()
    config = TrainingConfig(target_batch_size=16, mode="lora", lora_rank=4, lr=1, lr_schedule="cosine", total_steps=9)
    assert config.recipe_overrides() == {
        "lr": 1.0,
        "lr_schedule": LRSchedule.COSINE,
        "total_steps": 9,
        "batch_size": 16,
        "train_mode": TrainMode.LORA,
        "lora_rank": 4,
    }
    assert config.lr_schedule is LRSchedule.COSINE and config.mode is TrainMode.LORA
    assert config.recipe() == RunRecipe(**config.recipe_overrides())
    assert TrainConfig(optimizer="sgd", max_grad_norm=1).recipe_overrides() == {
        "optimizer": "sgd",
        "max_grad_norm": 1.0,
    }


@pytest.mark.parametrize("make", [TrainConfig, TrainingConfig])
@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(lr_schedule="linear"), r"lr_schedule must be one of \('constant', 'cosine'\), got 'linear'"),
        (dict(warmup_steps=-1), r"warmup_steps must be >= 0"),
        (dict(total_steps=2.5), r"total_steps must be an integer, got 2.5"),
        (dict(max_grad_norm=float("nan")), r"max_grad_norm must be finite and >= 0.0, got nan"),
        (dict(weight_decay=-1), r"weight_decay must be finite and >= 0.0, got -1"),
        (dict(lr_schedule="cosine", total_steps=3, warmup_steps=3), r"total_steps must exceed warmup_steps"),
    ],
)
def test_the_new_recipe_settings_are_checked_where_given(make, kwargs, words):
    with pytest.raises(ValueError, match=words):
        make(**kwargs)


def test_settings_that_only_the_run_can_complete_are_checked_when_a_run_starts():
    # cosine without total_steps: fine to join a run that has them, not to start one
    config = TrainConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="total_steps must exceed warmup_steps"):
        config.recipe()


def _train_config(*flags: str) -> TrainConfig:
    return config_from_args(build_parser("swarmlm train").parse_args(["model", *flags]))


def test_the_trainers_flags_map_onto_the_recipe_fields_and_default_to_not_given():
    assert _train_config().recipe_overrides() == {}
    assert _train_config().batch_size == 8
    assert _train_config().router_aux_loss_coef is None  # the model config's, as transformers trains it
    assert _train_config("--router-aux-loss-coef", "0.02").router_aux_loss_coef == 0.02  # a trainer's own setting
    config = _train_config(
        "--optimizer=adam",
        "--lr=0.001",
        "--weight-decay=0.1",
        "--warmup-steps=10",
        "--lr-schedule=cosine",
        "--total-steps=100",
        "--max-grad-norm=1",
    )
    assert config.recipe_overrides() == dict(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.1,
        warmup_steps=10,
        lr_schedule=LRSchedule.COSINE,
        total_steps=100,
        max_grad_norm=1.0,
    )
    help_text = " ".join(build_parser("swarmlm train").format_help().split())
    assert "(default: the run's; 0.0001 when starting one)" in help_text
    assert "{constant,cosine}" in help_text
