"""Which peers compute with the named LoRA adapter a client asked for (ClientConfig.adapter), and its local part.

Peers announce each adapter they serve with the digest of its folder (swarm/models/adapters.py). A client routes only
through peers announcing the one digest it uses: its own folder's when it has one (ClientConfig.adapter_path),
else the digest most peers announce. What an adapter replaces whole (embeddings, norm, head) the client applies
from its folder (client/model.py); without the folder such an adapter is refused, not computed halfway.
"""

from __future__ import annotations

from collections import Counter

from protocol.errors import BadRequestError
from protocol.records import ServerInfo, ServerState


def serving_adapter(servers: dict[str, ServerInfo], name: str, digest: str | None) -> dict[str, ServerInfo]:
    """The records of `servers` that serve adapter `name` with `digest` (None: the digest most ONLINE peers announce,
    the lowest of a tie).

    Raises:
        BadRequestError: that adapter replaces modules outside the blocks and `digest` is None (no local folder).
    """
    announced = {
        peer_id: adapter for peer_id, info in servers.items() for adapter in info.adapters if adapter.name == name
    }
    if digest is None:
        online = Counter(a.digest for peer_id, a in announced.items() if servers[peer_id].state == ServerState.ONLINE)
        if not online:
            return {}
        digest = min(online, key=lambda d: (-online[d], d))
        if any(a.client_modules for a in announced.values() if a.digest == digest):
            raise BadRequestError(
                f"adapter {name!r} also replaces the embeddings, norm or head, which this client computes: pass its "
                f"folder as adapter_path (swarmlm ... --adapter-path DIR)"
            )
    return {peer_id: servers[peer_id] for peer_id, a in announced.items() if a.digest == digest}
