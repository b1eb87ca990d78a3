"""A peer proves its key on the data plane by signing a client's nonce (swarm/trust/identity.py)."""

from __future__ import annotations

import pytest

from swarm.trust.identity import MAX_NONCE_BYTES, fresh_identity, identity_challenge, prove_identity, verify_signature


def test_a_proof_verifies_only_for_its_nonce_and_its_peer():
    peer, other = fresh_identity(), fresh_identity()
    try:
        proof = prove_identity(peer, b"nonce-1")
        assert verify_signature(peer.public_key, identity_challenge(b"nonce-1", peer.peer_id), proof)
        assert not verify_signature(peer.public_key, identity_challenge(b"nonce-2", peer.peer_id), proof)
        # the proof names the peer: it cannot stand for another record's owner, nor be made by another key
        assert not verify_signature(other.public_key, identity_challenge(b"nonce-1", other.peer_id), proof)
        forged = prove_identity(other, b"nonce-1")
        assert not verify_signature(peer.public_key, identity_challenge(b"nonce-1", peer.peer_id), forged)
        assert not verify_signature(peer.public_key, identity_challenge(b"nonce-1", peer.peer_id), b"garbage")
        with pytest.raises(ValueError, match=f"at most {MAX_NONCE_BYTES} bytes"):
            prove_identity(peer, bytes(MAX_NONCE_BYTES + 1))
    finally:
        for identity in (peer, other):
            identity.started()
