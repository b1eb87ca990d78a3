"""A peer's configuration: vocabularies are enums, serving limits are one nested config, flags map onto both."""

from __future__ import annotations

import contextlib
import io

import pytest

from peer.admission import WorkLimits
from peer.cli import build_parser, config_from_args
from peer.config import DTypeChoice, PeerConfig, ServingLimits, TrainingConfig, TransportMode
from protocol.vocab import DType, TrainMode, Transport, choices
from swarm.training.recipe import LRSchedule, RunRecipe


def test_string_values_become_members_and_keep_their_text():
    config = PeerConfig(model="m", transport="p2p", dtype="bfloat16")
    assert config.transport is TransportMode.P2P and config.dtype is DTypeChoice.BFLOAT16
    assert config.transport == "p2p" and f"{config.dtype}" == "bfloat16"
    assert TrainingConfig(mode="lora").mode is TrainMode.LORA
    assert PeerConfig(model="m").transport is TransportMode.AUTO and PeerConfig(model="m").dtype is DTypeChoice.AUTO


def test_the_peers_vocabularies_extend_the_wires():
    assert choices(DTypeChoice) == ("auto", *choices(DType))
    assert choices(TransportMode) == ("auto", *choices(Transport))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(transport="tcp"), r"transport must be one of \('auto', 'direct', 'p2p'\), got 'tcp'"),
        (dict(dtype="int8"), r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'int8'"),
        (dict(serving=dict(session_timeout_s=1.0)), "serving must be a ServingLimits, got dict"),
    ],
)
def test_bad_peer_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeerConfig(model="m", **kwargs)


def test_a_bad_train_mode_is_named():
    with pytest.raises(ValueError, match=r"train mode must be one of \('full', 'lora'\), got 'qlora'"):
        TrainingConfig(mode="qlora")


@pytest.mark.parametrize(
    "name",
    [
        "alloc_timeout_s",
        "max_alloc_timeout_s",
        "session_timeout_s",
        "session_lifetime_s",
        "write_timeout_s",
        "activation_ttl_s",
        "max_batch_tokens",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_serving_limits_must_be_positive(name, value):
    with pytest.raises(ValueError, match=f"^{name} must be positive, got {value}$"):
        ServingLimits(**{name: value})


def test_the_activation_cache_may_be_empty_but_not_negative():
    assert ServingLimits(activation_cache_bytes=0).activation_cache_bytes == 0
    with pytest.raises(ValueError, match=r"^activation_cache_bytes must be >= 0, got -1$"):
        ServingLimits(activation_cache_bytes=-1)


def test_serving_limits_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ServingLimits(10.0)
    with pytest.raises(AttributeError):
        ServingLimits().session_timeout_s = 1.0


def _config(*flags: str) -> PeerConfig:
    return config_from_args(build_parser("swarmlm peer").parse_args(["model", *flags]))


def test_the_defaults_of_the_flags_are_the_configs():
    config = _config()
    assert config.serving == ServingLimits() and config == PeerConfig(model="model")


def test_flags_map_onto_the_serving_limits():
    config = _config(
        "--alloc-timeout-s=3",
        "--session-timeout-s=4",
        "--session-lifetime-s=5",
        "--write-timeout-s=6",
        "--max-batch-tokens=7",
        "--activation-cache-mb=0.5",
        "--max-request-tokens=8",
        "--max-attention-cost=9",
        "--max-queued-tokens=10",
        "--max-queued-mb=2",
        "--max-cache-share=0.25",
        "--transport=direct",
        "--dtype=float16",
    )
    assert config.serving == ServingLimits(
        alloc_timeout_s=3.0,
        session_timeout_s=4.0,
        session_lifetime_s=5.0,
        write_timeout_s=6.0,
        max_batch_tokens=7,
        activation_cache_bytes=512 * 1024,
        work=WorkLimits(max_request_tokens=8, max_attention_cost=9, max_queued_tokens=10, max_queued_bytes=2 << 20),
    )
    assert config.max_cache_share == 0.25
    assert config.transport is TransportMode.DIRECT and config.dtype is DTypeChoice.FLOAT16


def test_a_negative_activation_cache_is_refused():
    with pytest.raises(ValueError, match="activation_cache_bytes must be >= 0"):
        _config("--activation-cache-mb=-0.000001")


def test_the_training_flags_map_onto_the_training_config():
    config = _config("--blocks=0:2", "--train", "--train-mode=lora")
    assert config.training.mode is TrainMode.LORA


def test_the_recipe_flags_are_not_given_unless_passed():
    assert _config("--blocks=0:2", "--train").training == TrainingConfig()
    assert _config("--blocks=0:2", "--train").training.recipe_overrides() == {}
    config = _config(
        "--blocks=0:2",
        "--train",
        "--optimizer=sgd",
        "--lr=0.01",
        "--weight-decay=0.1",
        "--warmup-steps=3",
        "--lr-schedule=cosine",
        "--total-steps=30",
        "--max-grad-norm=2",
        "--target-batch-size=16",
        "--train-mode=lora",
        "--lora-rank=4",
        "--averaging-compression=float16",
        "--local-steps=8",
        "--outer-lr=0.5",
        "--outer-momentum=0",
    )
    assert config.training.recipe() == RunRecipe(
        optimizer="sgd",
        lr=0.01,
        weight_decay=0.1,
        warmup_steps=3,
        lr_schedule=LRSchedule.COSINE,
        total_steps=30,
        max_grad_norm=2.0,
        batch_size=16,
        train_mode=TrainMode.LORA,
        lora_rank=4,
        averaging_compression="float16",
        local_steps=8,
        outer_lr=0.5,
        outer_momentum=0.0,
    )
    assert config.training.recipe_overrides().keys() == RunRecipe().to_wire().keys() - {"master_dtype"}


@pytest.mark.parametrize(
    "flag, vocabulary",
    [
        ("--transport", TransportMode),
        ("--dtype", DTypeChoice),
        ("--train-mode", TrainMode),
        ("--lr-schedule", LRSchedule),
    ],
)
def test_the_flags_choices_are_the_enums(flag, vocabulary):
    parser = build_parser("swarmlm peer")
    assert "{" + ",".join(choices(vocabulary)) + "}" in parser.format_help()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parser.parse_args(["model", f"{flag}=nonsense"])
    assert "invalid choice: 'nonsense'" in err.getvalue()
