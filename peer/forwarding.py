"""Peer-to-peer forwarding of inference steps: a peer pushes its output of a step on to the next peer of the
client's route, so that the step travels client -> peer 1 -> peer 2 -> ... and the next peer need not wait for
the client. Each peer still answers the client on its own stream (the client keeps the history it replays after
a failure); a push that fails is reported there too (ForwardFailed), and the client sends the next peer its steps itself.

The client names each next hop in the step (`InferenceStep.next`): its endpoint, the session the client opened
there, that session's push token, and the hop's step id. The next peer accepts the push only for a session that
holds that token (peer/inference.py `push`), and checks the pushed tensor as it checks a client's.

Pushes go only to direct gRPC endpoints ("host:port") that ONLINE records of the model announce: a peer pushes to
no other address a client names (which would make it a relay towards any host, and a port scanner). The endpoints
are read from the directory when a push names one not seen yet, at most every DIRECTORY_REFRESH_S. A hop reached
through libp2p is driven by the client.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable

import grpc
import torch

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError, PeerUnavailableError, SwarmError
from protocol.packing import Packer
from protocol.service import WINDOW_OPTIONS, PeerStub, error_from_rpc
from swarm.net.tunnel import TunnelPool, is_tunnel
from swarm.runtime import in_background
from swarm.trust.rpcauth import RpcAuth, call_metadata, open_channel

logger = logging.getLogger(__name__)

MAX_HOPS = 64  # next hops one step may name
MAX_TOKEN_BYTES = 64
MAX_CHANNELS = 32  # channels to next peers kept open; beyond, the least recently used is closed
PUSH_TIMEOUT_S = 10.0
DIRECTORY_REFRESH_S = 5.0  # the directory is read again for an endpoint not seen, at most this often
_ENDPOINT = re.compile(r"[^\s:/]{1,253}:\d{1,5}")


def check_next(hops, blocks_left: int) -> None:
    """Raise BadRequestError for next hops that cannot be pushed to.

    A route names each later span once, and each span holds a block at least: more hops than the blocks after this
    span, or one hop twice, would make one step cost more prefills than the model has spans.
    """
    most = min(MAX_HOPS, blocks_left)
    if len(hops) > most:
        raise BadRequestError(
            f"a step names at most {most} next hops here (the blocks after this span), got {len(hops)}"
        )
    if len({hop.endpoint for hop in hops}) < len(hops):
        raise BadRequestError("a step names a next hop's endpoint twice; a route passes each peer once")
    for hop in hops:
        if not _ENDPOINT.fullmatch(hop.endpoint):
            raise BadRequestError(f"a next hop's endpoint must be a gRPC host:port, got {hop.endpoint[:80]!r}")
        if not hop.session_id or len(hop.push_token) > MAX_TOKEN_BYTES or not hop.push_token:
            raise BadRequestError("a next hop needs its session id and push token (at most 64 bytes)")


class NotAnnounced(Exception):
    """A next hop's endpoint that no ONLINE record of the model announces: nothing is pushed there."""


class Forwarder:
    """Channels to the next peers, and the push of one step's output (and the identity pings of placement).

    Args:
        endpoints: reads the endpoints that ONLINE records of the model announce (None: pushes go to any endpoint,
            for tests of one peer alone).
    """

    def __init__(
        self,
        auth: RpcAuth | None,
        max_message_bytes: int,
        endpoints: Callable[[], Awaitable[set[str]]] | None = None,
    ):
        self.auth = auth
        self._read_endpoints = endpoints
        self._endpoints: set[str] = set()
        self._read_at = -math.inf
        self._options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            *WINDOW_OPTIONS,
        ]
        self._stubs: collections.OrderedDict[str, tuple[grpc.aio.Channel, PeerStub]] = collections.OrderedDict()
        self.tunnels: TunnelPool | None = None  # set once the peer's DHT node is final (peer/server.py)
        self.pushed = 0

    async def announced(self, endpoint: str) -> bool:
        """Whether an ONLINE record of the model announces `endpoint` (read again if it is new to this peer)."""
        if self._read_endpoints is None or endpoint in self._endpoints:
            return True
        if time.monotonic() - self._read_at >= DIRECTORY_REFRESH_S:
            self._read_at = time.monotonic()  # before the read: pushes meanwhile do not start reads of their own
            try:
                self._endpoints = await self._read_endpoints()
            except Exception as exc:  # the DHT did not answer: keep what was read before
                logger.warning("could not read the directory to check a push's next hop: %s", exc)
        return endpoint in self._endpoints

    def _stub(self, endpoint: str) -> PeerStub:
        if endpoint in self._stubs:
            self._stubs.move_to_end(endpoint)
            return self._stubs[endpoint][1]
        if len(self._stubs) >= MAX_CHANNELS:
            _, (channel, _) = self._stubs.popitem(last=False)
            in_background(channel.close())  # the least recently used: its close can finish on its own
        channel = open_channel(endpoint, self._options, self.auth)
        self._stubs[endpoint] = (channel, PeerStub(channel))
        return self._stubs[endpoint][1]

    async def push(
        self,
        hops,
        output: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        step: pb.InferenceStep,
    ) -> None:
        """Push `output` (this peer's result of `step`) as the input of the session of `hops[0]`.

        Raises SwarmError when the next peer refused it or could not be reached, NotAnnounced when no ONLINE record
        of the model announces its endpoint.
        """
        hop = hops[0]
        if not await self.announced(hop.endpoint):
            raise NotAnnounced(hop.endpoint)
        packer = Packer()
        request = packer.pack(
            pb.PushRequest(
                push_token=hop.push_token,
                step=pb.InferenceStep(
                    session_id=hop.session_id,
                    hidden_states=packer.tensor(output, step.output_compression),  # as the client would send it
                    attention_mask=packer.optional(mask),
                    position_ids=packer.optional(positions),
                    prefix_length=step.prefix_length,
                    step_id=hop.step_id,
                    output_compression=step.output_compression,
                    next=list(hops[1:]),
                ),
            )
        )
        try:
            await self._stub(hop.endpoint).push(
                request, timeout=PUSH_TIMEOUT_S, metadata=call_metadata(self.auth, "push")
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, hop.endpoint) from exc
        self.pushed += 1

    async def prove(self, endpoint: str, nonce: bytes, timeout_s: float) -> bytes:
        """The identity proof for `nonce` that the server at `endpoint` answers an Info call with (placement checks
        the records it counts so: peer/placement_view.py). A peer reached only through libp2p ("p2p:...") is asked
        through a tunnel of this peer's DHT node (`tunnels`)."""
        target = endpoint
        if is_tunnel(endpoint):  # its listener's address, asked each time: the pool may have closed and reopened it
            if self.tunnels is None:
                raise PeerUnavailableError(
                    f"{endpoint} is reached only through libp2p, and this peer has no tunnels yet"
                )
            target = await self.tunnels.local_endpoint(endpoint)
        try:
            answer = await self._stub(target).info(
                pb.InfoRequest(nonce=nonce), timeout=timeout_s, metadata=call_metadata(self.auth, "info")
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, endpoint) from exc
        return answer.identity_proof

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
        if self.tunnels is not None:
            await self.tunnels.close()


def failure_report(exc: Exception) -> str:
    """What the client hears of a failed push: the next peer's typed refusal, or only that it was not reached.

    Not the transport's own words: those tell a refused port from a filtered one, which would make a peer a port
    scanner for whoever names hops.
    """
    if isinstance(exc, NotAnnounced):
        return "no ONLINE peer of this model announces the next hop's endpoint; nothing was pushed there"
    if isinstance(exc, SwarmError) and not isinstance(exc, PeerUnavailableError):
        return f"the next peer refused the step ({exc.code})"
    return "the next peer could not be reached"
