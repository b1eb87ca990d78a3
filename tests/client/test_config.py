"""ClientConfig's forward_steps vocabulary (client/config.py), and the spellings it had before it."""

from __future__ import annotations

import dataclasses

import pytest

from client.config import ClientConfig, ForwardSteps

PEERS = ("/ip4/127.0.0.1/tcp/1",)


@pytest.mark.parametrize(
    "given, stored",
    [
        (True, ForwardSteps.ALWAYS),
        (False, ForwardSteps.NEVER),
        ("auto", ForwardSteps.AUTO),
        ("always", ForwardSteps.ALWAYS),
        ("never", ForwardSteps.NEVER),
        (ForwardSteps.NEVER, ForwardSteps.NEVER),
    ],
)
def test_forward_steps_is_stored_as_a_member(given, stored):
    config = ClientConfig(initial_peers=PEERS, forward_steps=given)
    assert config.forward_steps is stored and type(config.forward_steps) is ForwardSteps


def test_forward_steps_defaults_to_auto_and_survives_replace():
    config = ClientConfig(initial_peers=PEERS)
    assert config.forward_steps is ForwardSteps.AUTO and config.forward_steps == "auto"
    assert dataclasses.replace(config, forward_steps=False).forward_steps is ForwardSteps.NEVER


@pytest.mark.parametrize("bad", [None, "yes", 1, 0, "AUTO"])
def test_other_forward_steps_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match=r"forward_steps must be one of \('auto', 'always', 'never'\), True or False"):
        ClientConfig(initial_peers=PEERS, forward_steps=bad)
