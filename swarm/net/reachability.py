"""Can the swarm connect to this peer? Ask a neighbour to try.

A starting peer sends its gRPC endpoint to a few of its DHT neighbours (`probe`); each one that runs a
`ProbeService` (the bootstrap node and every peer do) opens a gRPC connection to it and calls Info, and says
whether the peer answered with the id it called from. The peer goes by the majority: reachable peers announce
their endpoint, the others serve through relays (swarm/net/relay.py).

A neighbour probes only the address the request comes from: the endpoint's host must be the IP address of the
libp2p connection the request arrived on. Otherwise any process could make every peer of the swarm open
connections wherever it liked. Behind NAT the two differ anyway, and that is the answer: not reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import hivemind
from hivemind.p2p import PeerID

from protocol import swarmlm_pb2 as pb
from protocol.errors import BadRequestError
from protocol.service import PeerStub
from swarm.net.tunnel import OPEN_TIMEOUT_S, read_message, write_message
from swarm.trust.rpcauth import RpcAuth, call_metadata, open_channel

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "/swarmlm/1/probe"
PROBE_TIMEOUT_S = 3.0
_ENDPOINT = re.compile(r"([^\s:]+):(\d{1,5})")


@dataclass(frozen=True)
class Reachability:
    reachable: bool | None
    """The majority's answer; None when no neighbour answered (nobody to ask, or nobody probes)."""
    details: tuple[str, ...] = ()


def observed_ip(maddr) -> str | None:
    """The IP address of a libp2p connection's remote multiaddr, or None (a relayed or unknown address)."""
    for protocol in ("ip4", "ip6"):
        try:
            return str(ipaddress.ip_address(maddr[protocol]))
        except Exception:  # no such part, or not an address
            continue
    return None


async def _resolve(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None), PROBE_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return set()
    return {str(ipaddress.ip_address(info[4][0])) for info in infos}


async def check_endpoint(
    endpoint: str, peer_id: str, observed: str | None, auth: RpcAuth | None = None
) -> pb.ProbeResponse:
    """Whether the gRPC server at `endpoint` answers Info as `peer_id`, trying only if its host is `observed`.

    In a private swarm (`auth`) the call is TLS with a tag, so only a member can answer, and only a member is asked.
    """
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None or not 0 < int(match.group(2)) < 65536:
        return pb.ProbeResponse(reachable=False, detail=f"{endpoint!r} is not a host:port")
    host, port = match.group(1), int(match.group(2))
    if observed is None or observed not in await _resolve(host):
        return pb.ProbeResponse(
            reachable=False,
            detail=f"the endpoint's host {host} is not the address this request came from ({observed or 'unknown'})",
        )
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        async with open_channel(target, auth=auth) as channel:
            answer = await PeerStub(channel).info(
                pb.InfoRequest(), timeout=PROBE_TIMEOUT_S, metadata=call_metadata(auth, "info")
            )
    except grpc.RpcError as exc:
        return pb.ProbeResponse(reachable=False, detail=f"{endpoint} did not answer: {exc.code().name}")
    if answer.peer_id != peer_id:
        return pb.ProbeResponse(reachable=False, detail=f"{endpoint} answered as {answer.peer_id}, not {peer_id}")
    return pb.ProbeResponse(reachable=True, detail=f"{endpoint} answered")


class ProbeService:
    """Answers probes on `p2p` (a replica of this process's DHT daemon), a few at a time."""

    def __init__(self, p2p: hivemind.P2P, *, max_concurrent: int = 4, auth: RpcAuth | None = None):
        self.p2p, self.auth = p2p, auth
        self._slots = asyncio.Semaphore(max_concurrent)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(PROBE_PROTOCOL, self._handle)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):  # the daemon may be gone already
            await self.p2p.remove_binary_stream_handler(PROBE_PROTOCOL)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_message(reader, pb.ProbeRequest)
            if self._slots.locked():
                answer = pb.ProbeResponse(reachable=False, detail="busy probing others; ask another neighbour")
            else:
                async with self._slots:
                    answer = await check_endpoint(
                        request.endpoint, info.peer_id.to_base58(), observed_ip(info.addr), self.auth
                    )
            await write_message(writer, answer)
        except (BadRequestError, ConnectionError, OSError) as exc:
            logger.debug("a probe from %s failed: %r", info.peer_id, exc)
        finally:
            writer.close()


async def _ask(p2p: hivemind.P2P, neighbour: PeerID, endpoint: str) -> pb.ProbeResponse:
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(neighbour, PROBE_PROTOCOL), OPEN_TIMEOUT_S
    )
    try:
        await write_message(writer, pb.ProbeRequest(endpoint=endpoint))
        return await read_message(reader, pb.ProbeResponse, timeout_s=PROBE_TIMEOUT_S + OPEN_TIMEOUT_S)
    finally:
        writer.close()


async def probe(p2p: hivemind.P2P, neighbours: Sequence[PeerID], endpoint: str, *, ask: int = 3) -> Reachability:
    """Ask up to `ask` of `neighbours` whether they can reach `endpoint` (ours); ties count as unreachable."""
    chosen = list(dict.fromkeys(neighbours))[:ask]
    results = await asyncio.gather(*(_ask(p2p, n, endpoint) for n in chosen), return_exceptions=True)
    votes, details = [], []
    for neighbour, result in zip(chosen, results):
        if isinstance(result, BaseException):
            details.append(f"{neighbour}: no answer ({result!r})")
        else:
            votes.append(result.reachable)
            details.append(f"{neighbour}: {result.detail}")
    if not votes:
        return Reachability(None, tuple(details))
    return Reachability(2 * sum(votes) > len(votes), tuple(details))
