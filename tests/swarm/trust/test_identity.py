"""swarm.trust.identity: key files, per-peer slots, and the owner subkey that ties a record to a libp2p peer id."""

from __future__ import annotations

import pickle

import pytest
from hivemind.p2p import PeerID

from swarm.trust.identity import (
    claim_identity,
    fresh_identity,
    load_identity,
    looks_like_record_subkey,
    parse_record_subkey,
    peer_id_of,
    verify_signature,
)


def test_a_key_file_is_created_once_and_gives_libp2ps_peer_id(tmp_path):
    path = tmp_path / "peer.key"
    first = load_identity(path)
    assert path.exists()
    assert first.peer_id == PeerID.from_identity(path.read_bytes()).to_base58()  # what p2pd will run as
    assert peer_id_of(first.public_key) == first.peer_id
    again = load_identity(path)
    assert again.peer_id == first.peer_id and again.public_key == first.public_key


def test_a_file_that_is_not_a_key_is_a_clear_error(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="is not an RSA libp2p identity file"):
        load_identity(path)


def test_peers_sharing_a_cache_dir_take_a_slot_each_and_get_theirs_back(tmp_path):
    first, second = claim_identity(tmp_path), claim_identity(tmp_path)
    assert first.path.name == "peer-0.key" and second.path.name == "peer-1.key"
    assert first.peer_id != second.peer_id
    first_id = first.peer_id
    first.release()  # the first peer stops; restarted, it is the same peer again
    restarted = claim_identity(tmp_path)
    assert restarted.path.name == "peer-0.key" and restarted.peer_id == first_id
    restarted.release()
    second.release()


def test_a_fresh_key_leaves_no_file_once_started():
    identity = fresh_identity()
    assert identity.path.exists()
    identity.started()
    assert not identity.path.exists() and not identity.path.parent.exists()


def test_the_key_signs_and_survives_pickling_into_the_dht_process():
    identity = fresh_identity()
    identity.started()
    key = pickle.loads(pickle.dumps(identity.private_key))
    signature = key.sign(b"nonce")
    assert verify_signature(identity.public_key, b"nonce", signature)
    assert not verify_signature(identity.public_key, b"other", signature)
    assert not verify_signature(b"ssh-rsa garbage", b"nonce", signature)


def test_an_owner_subkey_parses_only_when_its_peer_id_is_its_keys():
    mine, theirs = fresh_identity(), fresh_identity()
    mine.started(), theirs.started()
    assert parse_record_subkey(mine.record_subkey()) == (mine.peer_id, mine.public_key)
    claimed = f"{theirs.peer_id}[owner:{mine.public_key.decode()}]"  # my key, someone else's peer id
    assert looks_like_record_subkey(claimed)
    assert parse_record_subkey(claimed) is None
    for subkey in [
        mine.peer_id,
        f"{mine.peer_id}[owner:ssh-rsa AAAA]",
        mine.record_subkey() + "x",
        mine.record_subkey().encode(),
        None,
        7,
    ]:
        assert parse_record_subkey(subkey) is None
