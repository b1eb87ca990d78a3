"""A DHT node's key: its libp2p identity (RSA), which also signs the node's DHT records.

One key does both jobs, so a block record's owner is the libp2p peer that clients dial: its subkey is
`"<peer id>[owner:<ssh-rsa public key>]"` (`record_subkey`), hivemind's RSASignatureValidator lets only the holder
of that key write it, and a reader checks that the peer id is the one the key hashes to (`parse_record_subkey`),
so nobody can write a record in another peer's name. libp2p's handshake proves the same key on every connection.

Keys live in libp2p's identity file format (what `swarmlm bootstrap --identity` writes). A peer keeps one in its
cache dir (`claim_identity`) so that its peer id, and whatever clients learned about it, survive restarts; clients
and other short-lived nodes take a fresh one per run (`fresh_identity`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

MAX_IDENTITY_SLOTS = 64  # peers of one cache dir running at once
_SUBKEY = re.compile(r"([1-9A-HJ-NP-Za-km-z]{32,64})\[owner:(ssh-rsa [A-Za-z0-9+/=]{1,2048})\]")


class _LoadedRSAPrivateKey(RSAPrivateKey):
    """hivemind's RSA key type around a key read from a file (its constructor only generates new ones)."""

    def __init__(self, key):
        self._private_key = key


@dataclass
class NodeIdentity:
    """A key file, the key in it, and the peer id it gives (`lock` holds a claimed slot while the node runs)."""

    path: Path
    private_key: RSAPrivateKey
    peer_id: str
    temporary: bool = False
    lock: IO | None = field(default=None, repr=False)

    @property
    def public_key(self) -> bytes:
        """The public key as RSASignatureValidator writes it into an owner marker (OpenSSH format)."""
        return self.private_key.get_public_key().to_bytes()

    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.private_key)

    def record_subkey(self) -> str:
        return f"{self.peer_id}[owner:{self.public_key.decode()}]"

    def started(self) -> None:
        """The node has read its key file: a temporary one is removed (the key stays in this process's memory)."""
        if self.temporary:
            self.path.unlink(missing_ok=True)
            self.path.parent.rmdir()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def load_identity(path: str | os.PathLike) -> NodeIdentity:
    """The identity in the libp2p key file at `path`, which is created if missing.

    Raises:
        ValueError: the file is not an RSA libp2p identity.
    """
    path = Path(path)
    if not path.exists():
        P2P.generate_identity(str(path))
    data = path.read_bytes()
    try:
        protobuf = crypto_pb2.PrivateKey.FromString(data)
        if protobuf.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"key type {protobuf.key_type}")
        key = serialization.load_der_private_key(protobuf.data, password=None)
    except Exception as exc:
        raise ValueError(f"{path} is not an RSA libp2p identity file ({exc}); remove it to get a new one") from exc
    return NodeIdentity(path, _LoadedRSAPrivateKey(key), PeerID.from_identity(data).to_base58())


def fresh_identity() -> NodeIdentity:
    """A new key, in a private temporary file until the node has read it (`NodeIdentity.started`)."""
    identity = load_identity(Path(tempfile.mkdtemp(prefix="swarmlm-identity-")) / "identity.key")
    identity.temporary = True
    return identity


def claim_identity(directory: str | os.PathLike) -> NodeIdentity:
    """The first of `directory`/peer-N.key that no other running process holds, locked for this process.

    Two nodes with one peer id would break each other, so peers that share a cache dir take a slot each; a peer
    that restarts gets the first free slot again, which is its old one when it ran alone.

    Raises:
        OSError: all MAX_IDENTITY_SLOTS slots are taken.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for slot in range(MAX_IDENTITY_SLOTS):
        lock = open(directory / f"peer-{slot}.lock", "a")  # noqa: SIM115 (held while the process runs)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            identity = load_identity(directory / f"peer-{slot}.key")
        except BaseException:
            lock.close()
            raise
        identity.lock = lock
        return identity
    raise OSError(
        f"all {MAX_IDENTITY_SLOTS} peer identities in {directory} are in use by running peers; "
        f"give this peer another cache dir"
    )


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key (OpenSSH format): the sha2-256 multihash of its protobuf encoding,
    as libp2p (and PeerID.from_identity) derive it.

    Raises:
        ValueError: not an RSA public key.
    """
    key = serialization.load_ssh_public_key(public_key)
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA public key")
    der = key.public_bytes(encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def parse_record_subkey(subkey: Any) -> tuple[str, bytes] | None:
    """(peer id, public key) of a block record's subkey, or None unless it is `record_subkey` of a real key.

    A subkey without an owner marker is writable by anyone, and one whose peer id is not its key's could be
    written by anyone with a key: neither says who serves.
    """
    if not isinstance(subkey, str) or not (match := _SUBKEY.fullmatch(subkey)):
        return None
    peer_id, public_key = match.group(1), match.group(2).encode()
    try:
        return (peer_id, public_key) if peer_id_of(public_key) == peer_id else None
    except Exception:  # not a key at all
        return None


def looks_like_record_subkey(subkey: Any) -> bool:
    """Whether `subkey` has the form of a block record's (cheap: no key is parsed)."""
    return isinstance(subkey, str) and _SUBKEY.fullmatch(subkey) is not None


def verify_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Whether `signature` (base64, as hivemind's RSAPrivateKey.sign writes it) is `public_key`'s over `data`.

    `public_key` is a peer's key as the directory read it (SwarmSnapshot.public_keys).
    """
    try:
        return RSAPublicKey.from_bytes(public_key).verify(data, signature)
    except Exception:
        return False


MAX_NONCE_BYTES = 64


def identity_challenge(nonce: bytes, peer_id: str) -> bytes:
    """What a peer signs to prove, on its data plane, that it holds `peer_id`'s key (an Info call's nonce).

    The peer id is in it so that a proof made for one peer cannot stand for another's record.
    """
    return b"swarmlm-identity-v1\0" + peer_id.encode() + b"\0" + nonce


def prove_identity(identity: NodeIdentity, nonce: bytes) -> bytes:
    """The peer's answer to a client's nonce (see `identity_challenge`)."""
    if len(nonce) > MAX_NONCE_BYTES:
        raise ValueError(f"an identity nonce has at most {MAX_NONCE_BYTES} bytes, got {len(nonce)}")
    return identity.private_key.sign(identity_challenge(nonce, identity.peer_id))
