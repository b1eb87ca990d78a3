"""Swarm key files and the tags derived from them: plain data, no network."""

from __future__ import annotations

import os
import stat
import time

import pytest

from swarm.trust.swarmkey import KEY_BYTES, SwarmKey, create_key_file


def test_a_created_key_file_is_private_loads_back_and_is_never_overwritten(tmp_path):
    path = tmp_path / "swarm.key"
    key = create_key_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert SwarmKey.load(path).secret == key.secret and len(key.secret) == KEY_BYTES
    with pytest.raises(ValueError, match="already exists"):
        create_key_file(path)
    assert SwarmKey.load(path).secret == key.secret  # untouched
    assert create_key_file(tmp_path / "other.key").secret != key.secret


@pytest.mark.parametrize("content", ["", "zz" * KEY_BYTES, "ab" * (KEY_BYTES - 1), "ab" * (KEY_BYTES + 1)])
def test_a_file_that_is_not_a_key_is_refused_by_name(tmp_path, content):
    path = tmp_path / "swarm.key"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"swarm key file {path} does not hold a swarm key"):
        SwarmKey.load(path)


def test_a_missing_file_says_how_to_create_one(tmp_path):
    with pytest.raises(ValueError, match="--new-swarm-key"):
        SwarmKey.load(tmp_path / "nope.key")


def test_the_secret_never_shows_and_derived_keys_differ():
    key = SwarmKey(bytes(range(KEY_BYTES)))
    assert key.secret.hex() not in repr(key) and key.key_id in key.describe()
    assert len({key.derive("dht"), key.derive("rpc-call"), key.derive("rpc-tls"), key.secret}) == 4
    assert SwarmKey(bytes(range(KEY_BYTES))).key_id == key.key_id != SwarmKey(bytes(KEY_BYTES)).key_id
    with pytest.raises(ValueError, match="32 bytes"):
        SwarmKey(b"short")


def test_a_call_tag_is_accepted_once_for_its_method_and_only_under_its_key():
    from swarm.trust.rpcauth import AUTH_METADATA_KEY, MAX_SKEW_S, RpcAuth

    auth, other = RpcAuth(SwarmKey(os.urandom(KEY_BYTES))), RpcAuth(SwarmKey(os.urandom(KEY_BYTES)))
    path = "/swarmlm.v1.Peer/Forward"
    metadata = auth.call_metadata("forward")
    assert auth.check(path, metadata) is None
    assert "replays" in auth.check(path, metadata)
    assert "not valid" in auth.check("/swarmlm.v1.Peer/Info", auth.call_metadata("forward"))
    assert "not valid" in other.check(path, auth.call_metadata("forward"))
    assert "no swarm key tag" in auth.check(path, ())
    assert "not valid" in auth.check(path, ((AUTH_METADATA_KEY, "1:2:3"),))
    stamp = f"{time.time() - 2 * MAX_SKEW_S:.3f}"
    old = ((AUTH_METADATA_KEY, f"{stamp}:{'00' * 16}:{auth._tag('forward', stamp, '00' * 16)}"),)
    assert "off this peer's clock" in auth.check(path, old)


def test_every_member_derives_the_same_certificate():
    from swarm.trust.rpcauth import RpcAuth

    secret = os.urandom(KEY_BYTES)
    assert RpcAuth(SwarmKey(secret))._cert_pem == RpcAuth(SwarmKey(secret))._cert_pem
    assert RpcAuth(SwarmKey(secret))._cert_pem != RpcAuth(SwarmKey(os.urandom(KEY_BYTES)))._cert_pem
