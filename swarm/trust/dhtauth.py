"""The DHT of a private swarm: every DHT request and response carries an HMAC keyed by the swarm key.

hivemind's DHTProtocol hands each outgoing request and response to an authorizer to sign, and drops each incoming
one that the authorizer does not validate (a dropped request is answered with an error, a dropped response counts
as no answer). This authorizer tags the whole message (its `auth.signature` left empty) with HMAC-SHA256 under a
key derived from the swarm key. A request also carries its time and a random nonce: one older or newer than
`MAX_SKEW_S`, or seen before, is dropped (no replays); a response carries its request's nonce, so it answers that
request only. So a node without the key can neither join (its pings go unanswered), nor read, nor write records,
and a keyed node ignores the answers of nodes without it.

The bundled p2pd has no private-network (PSK) option, so a stranger still reaches the libp2p daemon itself; what
it may do there is this DHT (refused here) and the streams of swarm/net/tunnel.py, whose gRPC is TLS with per-call
tags (swarm/trust/rpcauth.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.trust.swarmkey import SwarmKey

logger = logging.getLogger(__name__)

MAX_SKEW_S = 60.0  # clocks of members may differ by this much; a request older than this is refused
NONCE_BYTES = 16


class SwarmKeyAuthorizer(AuthorizerBase):
    """Tags and checks DHT messages with the swarm key (see the module's docstring)."""

    def __init__(self, key: SwarmKey):
        self._key = key.derive("dht")
        self._seen = TimedStorage()  # nonces of recent requests -> None, until they are too old to be accepted

    def _tag(self, kind: bytes, message) -> bytes:
        message.auth.signature = b""
        return hmac.new(self._key, kind + message.SerializeToString(), hashlib.sha256).digest()

    def _valid(self, kind: bytes, message) -> bool:
        tag = message.auth.signature
        return len(tag) == hashlib.sha256().digest_size and hmac.compare_digest(tag, self._tag(kind, message))

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key: object | None) -> None:
        request.auth.time = get_dht_time()
        request.auth.nonce = secrets.token_bytes(NONCE_BYTES)
        request.auth.signature = self._tag(b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        if not self._valid(b"request", request):
            logger.debug("refused a DHT request without a valid swarm key tag")
            return False
        now, nonce = get_dht_time(), request.auth.nonce
        if abs(request.auth.time - now) > MAX_SKEW_S:
            logger.debug("refused a DHT request %.0fs away from this clock", request.auth.time - now)
            return False
        with self._seen.freeze():
            if nonce in self._seen:
                logger.debug("refused a replayed DHT request")
                return False
        self._seen.store(nonce, None, now + 2 * MAX_SKEW_S)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = self._tag(b"response", response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        if not self._valid(b"response", response) or response.auth.nonce != request.auth.nonce:
            logger.debug("ignored a DHT response without a valid swarm key tag")
            return False
        return True
