"""Which peers a client's hidden states go through: pure functions over a SwarmSnapshot (no I/O).

- plan_inference_route: the lowest expected latency chain of spans, for generation (one client, latency bound);
  its steps may travel from peer to peer along the chain (ClientConfig.forward_steps), each peer answering the
  client.
- plan_forward_route: a throughput-weighted random chain, for forward/backward (many trainers, spread the load);
  the client sends each hop's request itself.
- dial_candidates: the addresses to try for a peer, best first (client/dialing.py pings them).

Only ONLINE servers are routed to: JOINING ones have not loaded their blocks yet, OFFLINE ones are leaving.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from protocol.errors import NoPeersError
from protocol.records import ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import tunnel_address

_MIN_THROUGHPUT = 1e-9  # a peer announcing 0 tokens/s is a last resort, not a division by zero


@dataclass(frozen=True)
class RouteHop:
    """Send blocks `[start, end)` to `peer_id` at `endpoint`: its gRPC "host:port", or a "p2p:..." address."""

    peer_id: str
    start: int
    end: int
    endpoint: str


def dial_candidates(peer_id: str, info: ServerInfo) -> list[str]:
    """The addresses to try for a peer, best first: its gRPC endpoint then libp2p straight to it, or, for a peer
    that announces libp2p only, through each of its relays (straight to it when it has none)."""
    if info.transport == "p2p":
        return [tunnel_address(peer_id, relay) for relay in info.relays] or [tunnel_address(peer_id)]
    return [info.endpoint, tunnel_address(peer_id)]


def plan_inference_route(
    snapshot: SwarmSnapshot,
    start: int,
    end: int,
    *,
    client_rtt_s: Mapping[str, float] | None = None,
    banned: Collection[str] = (),
    default_rtt_s: float = 0.005,
    min_cache_tokens: int = 0,
    model_name: str = "MODEL",
) -> list[RouteHop]:
    """The chain of spans covering `[start, end)` with the lowest expected latency per token.

    Shortest path over block boundaries: from boundary i, a usable server covering block i leads to
    any boundary j with i < j <= min(server.end_block, end), at a cost of

        rtt_s(peer) + (j - i) / (span_length * throughput)

    The RTT is the one this client measured to the peer (client/dialing.py). Every hop answers the
    client on its own stream, but a step may reach it from the previous peer rather than from the
    client (ClientConfig.forward_steps, peer/forwarding.py); that peer-to-peer leg is not measured
    here (nothing a peer announces is trusted for routing), so it is costed as the client's own.
    Throughput is announced for the peer's whole span, so one token crosses one of its blocks in
    1 / (span_length * throughput) seconds; a hop over part of a span costs that fraction of the
    span's time. Fewer hops thus win unless a hop is slow.

    Args:
        client_rtt_s: measured RTT from this client per peer id; others get `default_rtt_s`.
        banned: peer ids not to use (e.g. ones that just failed).
        min_cache_tokens: skip peers with less KV cache left than the session needs.
        model_name: how the model is named in the error message.

    Raises:
        ValueError: a bad block range or a negative RTT.
        NoPeersError: some block of the range has no usable peer; the message names the blocks.
    """
    _check_range(snapshot, start, end)
    rtts = client_rtt_s or {}
    usable: dict[str, ServerInfo] = {}
    skipped: dict[str, str] = {}
    for peer_id, info in _online_by_id(snapshot).items():
        if peer_id in banned:
            skipped[peer_id] = "banned"
        elif info.cache_tokens_left < min_cache_tokens:
            skipped[peer_id] = f"cache {info.cache_tokens_left} < {min_cache_tokens} tokens"
        else:
            usable[peer_id] = info
    _raise_if_uncovered(snapshot, start, end, usable, skipped, model_name)

    hop_rtt: dict[str, float] = {}
    for peer_id in usable:
        rtt = rtts.get(peer_id, default_rtt_s)
        if not rtt >= 0:
            raise ValueError(f"RTT to peer {peer_id} must be >= 0 seconds, got {rtt}")
        hop_rtt[peer_id] = rtt

    # Dijkstra: every block is covered (checked above), so every boundary up to `end` is reachable.
    best = {start: 0.0}
    came_from: dict[int, tuple[int, str]] = {}
    queue = [(0.0, start)]
    while queue:
        cost, i = heapq.heappop(queue)
        if i == end:
            break
        if cost > best[i]:
            continue  # a stale entry; i was settled cheaper
        for peer_id, info in usable.items():
            if not info.start_block <= i < info.end_block:
                continue
            per_block_s = 1.0 / ((info.end_block - info.start_block) * max(info.throughput, _MIN_THROUGHPUT))
            for j in range(i + 1, min(info.end_block, end) + 1):
                new_cost = cost + hop_rtt[peer_id] + (j - i) * per_block_s
                if new_cost < best.get(j, math.inf):
                    best[j] = new_cost
                    came_from[j] = (i, peer_id)
                    heapq.heappush(queue, (new_cost, j))

    hops: list[RouteHop] = []
    j = end
    while j != start:
        i, peer_id = came_from[j]
        hops.append(RouteHop(peer_id, i, j, usable[peer_id].endpoint))
        j = i
    hops.reverse()
    return _merge_same_peer(hops)


def plan_forward_route(
    snapshot: SwarmSnapshot,
    start: int,
    end: int,
    *,
    banned: Collection[str] = (),
    rng: random.Random | None = None,
    model_name: str = "MODEL",
    uniform: bool = False,
) -> list[RouteHop]:
    """A chain covering `[start, end)` that spreads forward/backward load by announced throughput.

    From `start`, pick among the ONLINE servers covering the current block with probability
    proportional to throughput (uniformly if all announce 0, or with `uniform`: a check's route, which a liar
    must not draw to itself by announcing a high figure), and take it as far as it goes, up to `end`. Each call
    draws anew, so many micro-batches share the swarm's capacity.

    Raises:
        ValueError: a bad block range.
        NoPeersError: some block of the range has no usable peer; the message names the blocks.
    """
    _check_range(snapshot, start, end)
    rng = rng or random.Random()
    usable: dict[str, ServerInfo] = {}
    skipped: dict[str, str] = {}
    for peer_id, info in _online_by_id(snapshot).items():
        if peer_id in banned:
            skipped[peer_id] = "banned"
        else:
            usable[peer_id] = info
    _raise_if_uncovered(snapshot, start, end, usable, skipped, model_name)

    hops: list[RouteHop] = []
    i = start
    while i < end:
        candidates = [(pid, info) for pid, info in usable.items() if info.start_block <= i < info.end_block]
        weights = [info.throughput for _, info in candidates]
        if sum(weights) > 0 and not uniform:
            peer_id, info = rng.choices(candidates, weights=weights)[0]
        else:
            peer_id, info = rng.choice(candidates)
        j = min(info.end_block, end)
        hops.append(RouteHop(peer_id, i, j, info.endpoint))
        i = j
    return hops


def _check_range(snapshot: SwarmSnapshot, start: int, end: int) -> None:
    if not 0 <= start < end <= snapshot.num_blocks:
        raise ValueError(f"block range [{start}, {end}) must satisfy 0 <= start < end <= {snapshot.num_blocks}")


def _online_by_id(snapshot: SwarmSnapshot) -> dict[str, ServerInfo]:
    # Sorted by peer id so a route (and a seeded draw) does not depend on the order records were read in.
    return {pid: info for pid, info in sorted(snapshot.servers.items()) if info.state == ServerState.ONLINE}


def _raise_if_uncovered(
    snapshot: SwarmSnapshot,
    start: int,
    end: int,
    usable: Mapping[str, ServerInfo],
    skipped: Mapping[str, str],
    model_name: str,
) -> None:
    """Raise NoPeersError naming the first run of blocks in `[start, end)` that no usable peer serves."""
    covered = [False] * (end - start)
    for info in usable.values():
        for block in range(max(info.start_block, start), min(info.end_block, end)):
            covered[block - start] = True
    if all(covered):
        return
    gap_start = start + covered.index(False)
    gap_end = gap_start
    while gap_end < end and not covered[gap_end - start]:
        gap_end += 1

    blocks = f"block {gap_start}" if gap_end - gap_start == 1 else f"blocks {gap_start}-{gap_end - 1}"
    # Say why peers that do serve these blocks were not used, so "no peer" is not misread as "none exist".
    reasons = dict(skipped)
    for peer_id, info in snapshot.servers.items():
        if info.state != ServerState.ONLINE:
            reasons[peer_id] = info.state.name
    excluded = [
        f"{peer_id} ({reasons[peer_id]})"
        for peer_id, info in sorted(snapshot.servers.items())
        if peer_id in reasons and info.start_block < gap_end and info.end_block > gap_start
    ]
    unused = f" (not used: {', '.join(excluded)})" if excluded else ""
    raise NoPeersError(
        f"no peer serves {blocks} of model {model_name}{unused}; "
        f"start one with `swarmlm peer {model_name} --blocks {gap_start}:{gap_end}`"
    )


def _merge_same_peer(hops: list[RouteHop]) -> list[RouteHop]:
    # With a zero RTT, equal-cost paths may split one peer's span into adjacent hops; one request is cheaper.
    merged: list[RouteHop] = []
    for hop in hops:
        if merged and merged[-1].peer_id == hop.peer_id and merged[-1].end == hop.start:
            merged[-1] = RouteHop(hop.peer_id, merged[-1].start, hop.end, hop.endpoint)
        else:
            merged.append(hop)
    return merged
