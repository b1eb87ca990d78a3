"""The data plane of a private swarm: gRPC over TLS, and a tag on every call, both derived from the swarm key.

- TLS: every member derives the same P-256 key from the swarm key and the same self-signed certificate for the
  name `SERVER_NAME` (deterministic ECDSA, so the bytes are equal too). A server proves it holds the swarm key by
  completing the handshake; a client trusts that certificate alone. So strangers can neither read the traffic nor
  pose as a peer. Tunneled calls (swarm/net/tunnel.py) carry the same TLS end to end: relays see only ciphertext.
- Per call: metadata `AUTH_METADATA_KEY` = "time:nonce:tag", the tag an HMAC of the method, time and nonce under
  another derived key. A server's interceptor refuses a call without a valid tag, older or newer than
  `MAX_SKEW_S`, or with a nonce it has seen, with UNAUTHENTICATED and the code `unauthorized`
  (protocol/errors.py UnauthorizedError): a client that skips verifying the server still is not served.

Any holder of the key can pose as any other holder: the key gates membership, it does not name members.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc

from protocol.errors import UnauthorizedError
from protocol.service import abort
from swarm.trust.swarmkey import SwarmKey

SERVER_NAME = "swarmlm.private"
AUTH_METADATA_KEY = "swarmlm-auth"
MAX_SKEW_S = 60.0
MAX_REMEMBERED_NONCES = 200_000  # ~ 3000 calls/s over the window of 2 x MAX_SKEW_S
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class RpcAuth:
    """TLS credentials and per-call tags of one swarm key; one per process (building the certificate is ~1 ms)."""

    def __init__(self, key: SwarmKey):
        self.key = key
        self._call_key = key.derive("rpc-call")
        self._key_pem, self._cert_pem = _certificate(key)
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # nonce -> time it was seen, oldest first

    # --- TLS ---

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._key_pem, self._cert_pem)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._cert_pem)

    # --- per-call tags ---

    def _tag(self, method: str, stamp: str, nonce: str) -> str:
        return hmac.new(self._call_key, f"{method}\n{stamp}\n{nonce}".encode(), hashlib.sha256).hexdigest()

    def call_metadata(self, method: str) -> tuple[tuple[str, str]]:
        """Metadata for one call of `method` (the Peer method's name, any case: "forward", "Forward")."""
        method = method.lower()
        stamp, nonce = f"{time.time():.3f}", secrets.token_hex(16)
        return ((AUTH_METADATA_KEY, f"{stamp}:{nonce}:{self._tag(method, stamp, nonce)}"),)

    def check(self, method_path: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call of `method_path` ("/swarmlm.v1.Peer/Forward") with `metadata` is refused; None if it is not."""
        value = next((v for k, v in metadata or () if k == AUTH_METADATA_KEY), None)
        if not isinstance(value, str):
            return "the call carries no swarm key tag"
        stamp, _, rest = value.partition(":")
        nonce, _, tag = rest.partition(":")
        method = method_path.rsplit("/", 1)[-1].lower()
        if not hmac.compare_digest(tag.encode(), self._tag(method, stamp, nonce).encode()):
            return "the call's swarm key tag is not valid for this swarm"
        now = time.time()
        if abs(float(stamp) - now) > MAX_SKEW_S:  # a valid tag: stamp is a number we wrote
            return f"the call's tag is {float(stamp) - now:+.0f}s off this peer's clock (at most {MAX_SKEW_S:g}s)"
        self._forget_before(now - 2 * MAX_SKEW_S)
        key = bytes.fromhex(nonce)
        if key in self._seen:
            return "the call replays an earlier one"
        self._seen[key] = now
        return None

    def _forget_before(self, oldest: float) -> None:
        while self._seen and (len(self._seen) >= MAX_REMEMBERED_NONCES or next(iter(self._seen.values())) < oldest):
            self._seen.popitem(last=False)

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _CheckCalls(self)


class _CheckCalls(grpc.aio.ServerInterceptor):
    def __init__(self, auth: RpcAuth):
        self.auth = auth

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        reason = self.auth.check(details.method, details.invocation_metadata)
        if handler is None or reason is None:
            return handler
        return _refusing(
            handler,
            UnauthorizedError(
                f"this peer serves a private swarm and {reason}: pass the swarm's key file with --swarm-key FILE "
                f"(ClientConfig.swarm_key)"
            ),
        )


def _refusing(handler: grpc.RpcMethodHandler, error: UnauthorizedError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with `error` before reading a request."""
    if handler.response_streaming:

        async def refuse_stream(request, context):
            await abort(context, error)
            yield  # unreachable: makes this an async generator, as a streaming handler must be

        make = (
            grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_stream_rpc_method_handler
        )
        return make(
            refuse_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def refuse(request, context):
        await abort(context, error)

    make = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make(
        refuse, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


def _certificate(key: SwarmKey) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM), the same bytes in every process that holds `key`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    scalar = int.from_bytes(key.derive("rpc-tls"), "big") % (_P256_ORDER - 1) + 1
    private = ec.derive_private_key(scalar, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmlm private swarm {key.key_id}")])
    utc = datetime.timezone.utc
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(int.from_bytes(key.derive("rpc-tls-serial")[:16], "big") >> 1)
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=utc))
        .not_valid_after(datetime.datetime(2120, 1, 1, tzinfo=utc))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .sign(private, hashes.SHA256(), ecdsa_deterministic=True)
    )
    key_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


# --- where channels and servers are made ---


def open_channel(
    target: str, options: Sequence[tuple[str, object]] = (), auth: RpcAuth | None = None
) -> grpc.aio.Channel:
    """A channel to a peer's gRPC server at `target`: plain for a public swarm, TLS to a swarm member with `auth`."""
    if auth is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(
        target, auth.channel_credentials(), options=[*options, ("grpc.ssl_target_name_override", SERVER_NAME)]
    )


def add_port(server: grpc.aio.Server, address: str, auth: RpcAuth | None = None) -> int:
    """Listen on `address`: plain for a public swarm, TLS with `auth`. The port bound, 0 if none could be."""
    if auth is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, auth.server_credentials())


def server_interceptors(auth: RpcAuth | None) -> list[grpc.aio.ServerInterceptor]:
    return [] if auth is None else [auth.interceptor()]


def call_metadata(auth: RpcAuth | None, method: str) -> tuple[tuple[str, str], ...] | None:
    return None if auth is None else auth.call_metadata(method)
