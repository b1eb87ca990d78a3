"""Swarm key files: the shared secret of a private swarm, and the keys derived from it.

A key file holds 32 random bytes as 64 hex digits (one line). Every use derives its own key from it
(HMAC-SHA256 of a label), so the DHT tags, the per-call tags and the TLS key never share bytes. Standard
library only: `--help` and flag errors never pay for cryptography, hivemind or grpc.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

KEY_BYTES = 32


@dataclass(frozen=True)
class SwarmKey:
    """The secret of a private swarm. Its repr shows only `key_id`, never the secret."""

    secret: bytes = field(repr=False)
    source: str = "(in memory)"
    """Where it was read from, for error messages."""

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != KEY_BYTES:
            raise ValueError(
                f"a swarm key is {KEY_BYTES} bytes, got "
                f"{len(self.secret) if isinstance(self.secret, bytes) else type(self.secret).__name__}"
            )

    def derive(self, label: str) -> bytes:
        """A 32-byte key for one use (`label`), independent of the keys of other labels."""
        return hmac.new(self.secret, b"swarmlm/" + label.encode(), hashlib.sha256).digest()

    @property
    def key_id(self) -> str:
        """A short public name of this key (safe to print): holders of the same key see the same id."""
        return self.derive("key-id").hex()[:12]

    def describe(self) -> str:
        return f"swarm key {self.key_id} from {self.source}"

    @classmethod
    def load(cls, path: str | os.PathLike) -> SwarmKey:
        """Read a key file written by `create_key_file` (`swarmlm bootstrap --new-swarm-key FILE`).

        Raises:
            ValueError: the file is missing or unreadable, or does not hold 64 hex digits.
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            raise ValueError(
                f"swarm key file {path} does not exist; create one with "
                f"`swarmlm bootstrap --new-swarm-key {path}` and copy it to every member"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read swarm key file {path}: {exc}") from None
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            secret = b""
        if len(secret) != KEY_BYTES:
            raise ValueError(
                f"swarm key file {path} does not hold a swarm key ({2 * KEY_BYTES} hex digits); "
                f"create one with `swarmlm bootstrap --new-swarm-key FILE`"
            )
        return cls(secret, str(path))


def create_key_file(path: str | os.PathLike) -> SwarmKey:
    """Write a new random key to `path`, readable by its owner only (mode 0600).

    Raises:
        ValueError: `path` already exists (a key is never overwritten: members holding it would be locked out).
    """
    path = Path(path)
    secret = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    except FileExistsError:
        raise ValueError(
            f"{path} already exists; a swarm key is never overwritten (delete it first if you mean "
            f"to lock out everyone who holds it), or use it with --swarm-key {path}"
        ) from None
    except OSError as exc:
        raise ValueError(f"cannot create swarm key file {path}: {exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(secret.hex() + "\n")
    return SwarmKey(secret, str(path))


def load_optional(path: str | None) -> SwarmKey | None:
    """`SwarmKey.load(path)`, or None for a public swarm (no path); a CLI turns its ValueError into a usage error."""
    return None if path is None else SwarmKey.load(path)


def refused_message(key: SwarmKey | None, initial_peers) -> str:
    """Why a node reached its initial peers but none answered its DHT requests, and what to do."""
    held = "this node has no swarm key" if key is None else f"this node holds {key.describe()}"
    return (
        f"the initial peers {' '.join(initial_peers)} were reached, but none answered this node's DHT requests: "
        f"they form another swarm, public or private, and {held}; pass the swarm's key file with "
        f"--swarm-key FILE (the same file as its bootstrap node's), or none for a public swarm"
    )


SWARM_KEY_HELP = (
    "key file of a private swarm (from `swarmlm bootstrap --new-swarm-key FILE`): only its holders "
    "can join the DHT, read its records and call peers (default: a public swarm)"
)
