"""Who may average with a training group of a private swarm.

hivemind's averaging RPCs (join a group, send tensor parts, download the state) run over the libp2p daemon,
and the bundled p2pd has no private-network key: a stranger that reaches it could join a round and feed the
group its own tensors, or download the weights. In a private swarm each member therefore puts a tag in the data
it gathers with its group, HMAC-SHA256 of its peer id under a key derived from the swarm key; a leader accepts a
join request only with the tag of the requester's peer id (which libp2p authenticates, so a tag seen in a round
is no use to anyone else). Tensor parts are accepted only from members of a group so formed (hivemind checks
that), and the state is sent only to peers with a progress record of their own, signed by their key, in the group's
DHT record (only key holders can write the DHT of a private swarm, swarm/trust/dhtauth.py; the signature ties the
record to the peer id libp2p authenticates, swarm/training/members.py).

Rounds among a known group (swarm/training/rounds.py) keep these guarantees without the tag: nobody joins them (every
join request is refused), their members come from a trainer's commit (which only key holders can send, over gRPC:
swarm/trust/rpcauth.py), parts are accepted only from those members, and the state goes out under the same rule.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from hivemind.utils.serializer import MSGPackSerializer

from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

TAG_FIELD = "member"
MAX_GATHER_BYTES = 1 << 16  # a join request's gathered data is a few dozen bytes; more is not one of ours


class GroupGate:
    """Tags this member's gathered data and checks those of others (see the module's docstring)."""

    def __init__(self, key: SwarmKey):
        self._key = key.derive("averaging")

    def tag(self, peer_id: bytes) -> bytes:
        return hmac.new(self._key, b"member:" + peer_id, hashlib.sha256).digest()

    def admits(self, gather: bytes, peer_id: bytes) -> bool:
        """Whether `gather` (a JoinRequest's field, as hivemind serializes it) carries the tag of `peer_id`."""
        if not isinstance(gather, bytes) or len(gather) > MAX_GATHER_BYTES:
            return False
        try:  # hivemind: [bandwidth, mode, serialized user data]; ours is a dict with the tag
            _, _, user = MSGPackSerializer.loads(gather)
            tag = MSGPackSerializer.loads(user).get(TAG_FIELD)
        except Exception:
            return False
        return isinstance(tag, bytes) and hmac.compare_digest(tag, self.tag(peer_id))
