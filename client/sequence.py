"""The remote blocks of one model: routing, retries and forward/backward over chains of peers.

A failed peer is banned for a while (longer each time it fails), the directory is refreshed at once,
and the failed part of the chain is routed to other peers. A peer fails when it cannot be reached, or answers
with an error or with anything but what was asked for (client/checks.py: every answer is checked, and input
is checked here before it is sent, so that only the caller's bad input fails immediately).

A random share of forward and backward hops (`verify_fraction`) is recomputed on other peers, and a peer
outvoted two to one is banned (client/verify.py).

Peers are reached only at the addresses of their records, which `fetch_snapshot` validated.

Each peer is reached by the first of its addresses that answers a ping (`routing.dial_candidates`): its gRPC
endpoint, or libp2p streams, straight or through its relays; the ping's time is the RTT routing counts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, replace

import hivemind
import torch

from client import checks, verify
from client.config import ClientConfig
from client.routing import RouteHop, dial_candidates, plan_forward_route, plan_inference_route
from client.transport import ChannelPool
from client.verify import Computed, SpotChecker
from protocol import swarmlm_pb2 as pb
from protocol.codec import parse_dtype
from protocol.errors import BadRequestError, NoPeersError, SwarmError
from protocol.packing import Packer
from protocol.records import ServerInfo
from swarm.dht.directory import fetch_snapshot
from swarm.dht.snapshot import SwarmSnapshot
from swarm.net.tunnel import TunnelPool, is_tunnel
from swarm.trust.identity import identity_challenge

logger = logging.getLogger(__name__)

_MAX_BAN_S = 60.0
_STRIKES_HALF_LIFE_S = 600.0


def is_retriable(error: BaseException) -> bool:
    """Bad input is the caller's to fix, and NoPeersError comes after waiting already; the rest may work elsewhere.

    Decide on what `checks.blame` made of a peer's error: a peer's own bad_request means nothing here.
    """
    return isinstance(error, SwarmError) and not isinstance(error, (BadRequestError, NoPeersError))


def describe(hop: RouteHop) -> str:
    """A hop's peer, as error messages name it."""
    return f"{hop.peer_id} at {hop.endpoint}"


@dataclass(frozen=True)
class TrainingTag:
    """Marks backward calls as training steps of `run_id`, computed against each stage's update `epochs`."""

    run_id: str
    epochs: Mapping[tuple[int, int], int]


@dataclass
class HopRecord:
    """What one hop of a forward pass was sent, kept for its backward."""

    hop: RouteHop
    inputs: torch.Tensor
    backward_id: str = ""
    """Under which id the peer was asked to keep this hop's activations ("" if it was not)."""


class BanList:
    """Peers that failed recently.

    A ban lasts `base_s`, doubled with each repeated failure (strike) up to a minute. Strikes halve with each
    `half_life_s` without a new one, so that one slip long after a peer's last failures costs a short ban.
    After its ban a peer is used again only once it has announced itself since it failed: a crashed peer's
    record stays in the DHT until it expires, and without this rule the client would try the dead peer again
    each time its ban ran out.
    """

    def __init__(
        self, base_s: float, clock: Callable[[], float] = time.monotonic, half_life_s: float = _STRIKES_HALF_LIFE_S
    ):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.base_s, self.clock, self.half_life_s = base_s, clock, half_life_s
        self._until: dict[str, float] = {}
        self._strikes: dict[str, tuple[int, float]] = {}  # peer id -> (strikes, when the last one came)
        self._failed_at: dict[str, float] = {}
        # peer id -> expiration of its latest record in the first directory read after it failed
        self._last_record: dict[str, float] = {}

    def strikes(self, peer_id: str) -> int:
        """`peer_id`'s strikes now: its failures, halved (rounding down) per quiet `half_life_s` since the last."""
        count, at = self._strikes.get(peer_id, (0, 0.0))
        halvings = int((self.clock() - at) // self.half_life_s)
        return count >> min(max(halvings, 0), 63)

    def ban(self, peer_id: str, at_least_s: float = 0.0) -> float:
        """Ban `peer_id` for longer than last time, and `at_least_s`; returns the ban's length in seconds."""
        strikes = self.strikes(peer_id) + 1
        now = self.clock()
        self._strikes[peer_id] = (strikes, now)
        length_s = max(min(self.base_s * 2 ** (strikes - 1), _MAX_BAN_S), at_least_s)
        self._until[peer_id] = now + length_s
        self._failed_at[peer_id] = now
        self._last_record.pop(peer_id, None)
        return length_s

    def observe(self, expirations: Mapping[str, float], read_at: float) -> None:
        """Note the records of a directory read begun at `read_at` (clock time): what failed peers had announced."""
        for peer, failed_at in self._failed_at.items():
            if peer not in self._last_record and failed_at <= read_at:
                self._last_record[peer] = expirations.get(peer, -math.inf)

    def banned(self, expirations: Mapping[str, float] | None = None) -> set[str]:
        """Peers not to use: within their ban, or, given the latest records' expirations, silent since they failed."""
        now = self.clock()
        if expirations is None:
            return {peer for peer, until in self._until.items() if until > now}
        return {
            peer
            for peer, until in self._until.items()
            if until > now or expirations.get(peer, -math.inf) <= self._last_record.get(peer, math.inf)
        }


class RemoteSequence:
    """Blocks [0, num_blocks) of a model as served by the swarm. Its coroutines run on the client's loop."""

    def __init__(
        self,
        dht: hivemind.DHT,
        prefix: str,
        num_blocks: int,
        config: ClientConfig,
        run_id: str | None = None,
        *,
        hidden_size: int | None = None,
        max_positions: int | None = None,
    ):
        self.dht, self.prefix, self.num_blocks, self.config = dht, prefix, num_blocks, config
        self.run_id = run_id  # when set, only peers that train this run are used
        # the model's, to check inputs as the peers will (None: not checked here)
        self.hidden_size, self.max_positions = hidden_size, max_positions
        self._p2p: hivemind.P2P | None = None
        self.pool = ChannelPool(
            config.max_message_bytes, TunnelPool(self.p2p), max_channels=config.max_channels, swarm_key=config.swarm_key
        )
        self.bans = BanList(base_s=max(config.retry_delay_s * 4, 1.0))
        self._snapshot: SwarmSnapshot | None = None
        self._snapshot_at = 0.0
        self.failovers = 0  # peer failures seen (each one bans the peer and re-routes)
        self.recoveries = 0  # spans of inference sessions re-routed and replayed after them
        self.recovery_s = 0.0  # time inference sessions spent recovering from them
        self.rtts: dict[str, float] = {}  # peer id -> measured round-trip time in seconds
        self.paths: dict[str, str] = {}  # peer id -> the address its ping answered on
        # peer id -> the addresses its record announced when it was measured: a peer that comes back under the
        # same id (its key is kept) at another endpoint is measured afresh, not dialed at its old address
        self._measured_at: dict[str, tuple[str, ...]] = {}
        self.last_route: list[RouteHop] = []  # hops of the latest forward, for diagnostics
        self.spot_checks = SpotChecker(
            config.verify_fraction, self._ban_wrong_result, random.Random(config.verify_seed)
        )

    async def p2p(self) -> hivemind.P2P:
        """This client's handle on its DHT node's libp2p daemon, for peers reached through libp2p."""
        if self._p2p is None:
            self._p2p = await self.dht.replicate_p2p()
        return self._p2p

    # --- directory and routing ---

    async def snapshot(self, *, refresh: bool = False) -> SwarmSnapshot:
        stale = time.monotonic() - self._snapshot_at > self.config.directory_refresh_s
        if refresh or stale or self._snapshot is None:
            began = time.monotonic()
            snapshot = await asyncio.to_thread(fetch_snapshot, self.dht, self.prefix, self.num_blocks)
            if self.run_id is not None:
                snapshot = replace(
                    snapshot,
                    servers={pid: info for pid, info in snapshot.servers.items() if info.run_id == self.run_id},
                )
            self._snapshot = snapshot
            self._snapshot_at = time.monotonic()
            self.bans.observe(self._snapshot.expirations, read_at=began)
        return self._snapshot

    async def plan(
        self, start: int, end: int, *, inference: bool, min_cache_tokens: int = 0, refresh: bool = False
    ) -> list[RouteHop]:
        """A route for blocks [start, end); waits up to `wait_for_peers_s` for the swarm to cover them."""
        deadline = time.monotonic() + self.config.wait_for_peers_s
        delay = self.config.retry_delay_s
        waiting_for = ""
        while True:
            snapshot = await self.snapshot(refresh=refresh)
            try:
                if inference:
                    await self.measure_rtts(snapshot)
                    hops = plan_inference_route(
                        snapshot,
                        start,
                        end,
                        client_rtt_s=self.rtts,
                        banned=self.bans.banned(snapshot.expirations),
                        min_cache_tokens=min_cache_tokens,
                        model_name=self.prefix,
                    )
                else:
                    hops = plan_forward_route(
                        snapshot, start, end, banned=self.bans.banned(snapshot.expirations), model_name=self.prefix
                    )
                    await self.measure_rtts(snapshot, only={hop.peer_id for hop in hops})
                    if {hop.peer_id for hop in hops} & self.bans.banned():  # an impostor among them: plan again
                        hops = plan_forward_route(
                            snapshot, start, end, model_name=self.prefix, banned=self.bans.banned(snapshot.expirations)
                        )
                return [replace(hop, endpoint=self.paths.get(hop.peer_id, hop.endpoint)) for hop in hops]
            except NoPeersError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                if str(exc) != waiting_for:  # once per change of what is missing, not every retry
                    waiting_for = str(exc)
                    logger.info("waiting up to %.0f s more for peers: %s", deadline - time.monotonic(), exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            refresh = True

    async def measure_rtts(
        self, snapshot: SwarmSnapshot, timeout_s: float = 1.0, only: Collection[str] | None = None
    ) -> None:
        """Ping (an Info call) every ONLINE peer not measured yet (or those of `only`) on each of its addresses in
        turn; the first that answers is its path. One that does not answer gets `timeout_s`."""
        unknown = [
            (pid, info)
            for pid, info in snapshot.online().items()
            if (only is None or pid in only) and not self._measured(pid, info)
        ]
        await asyncio.gather(*(self._find_path(pid, info, timeout_s, snapshot) for pid, info in unknown))

    async def _find_path(
        self, peer_id: str, info: ServerInfo, timeout_s: float, snapshot: SwarmSnapshot | None = None
    ) -> str:
        """The first of the peer's addresses where the answer to a ping proves the peer's key (swarm/trust/identity.py).

        A server at an announced endpoint that cannot sign the nonce with the key of the record's owner is not
        that peer: the record points at someone else's server. Such a peer is banned (its record is a lie).
        """
        snapshot = snapshot or self._snapshot
        candidates = dial_candidates(peer_id, info)
        self._measured_at[peer_id] = tuple(candidates)
        self.paths.pop(peer_id, None)
        impostors = []
        for address in candidates:
            nonce = os.urandom(16)
            began = time.perf_counter()
            try:
                answer = await self.pool.unary(address, "info", pb.InfoRequest(nonce=nonce), timeout_s)
            except SwarmError as exc:
                logger.debug("peer %s does not answer at %s: %s", peer_id, address, exc)
                await self.pool.drop(address)
                continue
            rtt = time.perf_counter() - began
            if snapshot is None or not snapshot.verify(
                peer_id, identity_challenge(nonce, peer_id), answer.identity_proof
            ):
                impostors.append(address)
                await self.pool.drop(address)
                continue
            self.rtts[peer_id], self.paths[peer_id] = rtt, address
            if address != candidates[0]:
                logger.info("peer %s is reached at %s (not at %s)", peer_id, address, candidates[0])
            return address
        self.rtts[peer_id] = timeout_s
        if impostors:
            length_s = self.bans.ban(peer_id)
            logger.warning(
                "the server at %s does not hold the key of peer %s, whose record announces it: banned for %.0fs",
                ", ".join(impostors),
                peer_id,
                length_s,
            )
        return candidates[0]

    def _measured(self, peer_id: str, info: ServerInfo) -> bool:
        """Whether `peer_id` was measured at the addresses `info` announces."""
        return peer_id in self.rtts and self._measured_at.get(peer_id) == tuple(dial_candidates(peer_id, info))

    async def address_of(self, peer_id: str, info: ServerInfo, timeout_s: float = 1.0) -> str:
        """Where to send `peer_id`'s requests: the path its ping answered on, found now if it is not known."""
        if peer_id not in self.paths or not self._measured(peer_id, info):
            return await self._find_path(peer_id, info, timeout_s)
        return self.paths[peer_id]

    def forwards(self, hop: RouteHop) -> bool:
        """Whether `hop`'s peer takes and pushes on steps peer to peer: direct gRPC, protocol 2 or later."""
        if is_tunnel(hop.endpoint):
            return False
        info = self._snapshot.servers.get(hop.peer_id) if self._snapshot else None
        return info is not None and info.version.split(".")[0].isdigit() and int(info.version.split(".")[0]) >= 2

    def hop_dtype(self, hop: RouteHop) -> torch.dtype:
        info = self._snapshot.servers.get(hop.peer_id) if self._snapshot else None
        return parse_dtype(info.dtype) if info is not None else torch.float32

    async def report_failure(self, hop: RouteHop, error: BaseException) -> None:
        length_s = self.bans.ban(hop.peer_id)
        logger.warning(
            "peer %s (blocks %d:%d) failed, banned for %.0fs: %s", hop.peer_id, hop.start, hop.end, length_s, error
        )
        self.rtts.pop(hop.peer_id, None)  # measure it (and find its path) afresh if it comes back
        self.paths.pop(hop.peer_id, None)
        self.failovers += 1
        await self.pool.drop(hop.endpoint)

    async def backoff(self, attempt: int) -> None:
        """No wait before the first retry (the failed peer is banned, others are likely fine), then exponential."""
        if attempt > 0:
            await asyncio.sleep(min(self.config.retry_delay_s * 2 ** (attempt - 1), 5.0))

    # --- stateless forward / backward ---

    def check_inputs(self, hidden: torch.Tensor, mask, positions, prefix_length: int = 0) -> None:
        """Raise BadRequestError for inputs a peer would refuse, before anything is sent."""
        checks.check_inputs(
            hidden,
            mask,
            positions,
            hidden_size=self.hidden_size,
            max_positions=self.max_positions,
            prefix_length=prefix_length,
        )

    async def _call_forward(self, hop: RouteHop, hidden, mask, positions, backward_id: str) -> torch.Tensor:
        dtype = self.hop_dtype(hop)
        packer = Packer()
        request = packer.pack(
            pb.ForwardRequest(
                span=pb.Span(model=self.prefix, start=hop.start, end=hop.end),
                hidden_states=packer.tensor(hidden.to(dtype)),
                attention_mask=packer.optional(mask),
                position_ids=packer.optional(positions),
                backward_id=backward_id,
            )
        )
        checks.check_size(request, self.config.max_message_bytes)
        response = await self.pool.unary(hop.endpoint, "forward", request, self.config.request_timeout_s)
        output = checks.unary_answer(response, "hidden_states", peer=describe(hop), shape=hidden.shape, dtype=dtype)
        return output.to(hidden.dtype)

    async def _call_backward(
        self, hop: RouteHop, inputs, grad, mask, positions, backward_id: str, training: TrainingTag | None = None
    ) -> torch.Tensor:
        dtype = self.hop_dtype(hop)
        packer = Packer()
        run_id, epoch = (training.run_id, training.epochs.get((hop.start, hop.end), 0)) if training else ("", 0)
        request = packer.pack(
            pb.BackwardRequest(
                run_id=run_id,
                epoch=epoch,
                span=pb.Span(model=self.prefix, start=hop.start, end=hop.end),
                hidden_states=packer.tensor(inputs.to(dtype)),
                grad_outputs=packer.tensor(grad.to(dtype)),
                attention_mask=packer.optional(mask),
                position_ids=packer.optional(positions),
                backward_id=backward_id,
            )
        )
        checks.check_size(request, self.config.max_message_bytes)
        response = await self.pool.unary(hop.endpoint, "backward", request, self.config.request_timeout_s)
        grad_inputs = checks.unary_answer(response, "grad_inputs", peer=describe(hop), shape=inputs.shape, dtype=dtype)
        return grad_inputs.to(grad.dtype)

    async def forward(
        self,
        hidden: torch.Tensor,
        mask,
        positions,
        start: int = 0,
        end: int | None = None,
        keep_for_backward: bool = False,
    ) -> tuple[torch.Tensor, list[HopRecord]]:
        """Run blocks [start, end); return the outputs and what each hop was sent (for backward).

        With `keep_for_backward`, peers are asked to keep their activations until the backward, which then
        need not recompute the forward.

        Raises:
            BadRequestError: the inputs are not what a peer accepts (nothing was sent).
            NoPeersError: nobody serves some of the blocks.
            SwarmError: peers kept failing (`max_retries` route changes), e.g. PeerFaultError.
        """
        self.check_inputs(hidden, mask, positions)
        end = self.num_blocks if end is None else end
        records: list[HopRecord] = []
        block, attempt, refresh = start, 0, False
        while block < end:
            route = await self.plan(block, end, inference=False, refresh=refresh)
            for hop in route:
                backward_id = uuid.uuid4().hex if keep_for_backward else ""
                try:
                    output = await self._call_forward(hop, hidden, mask, positions, backward_id)
                except Exception as exc:
                    error = checks.blame(exc, describe(hop))
                    if not is_retriable(error) or attempt >= self.config.max_retries:
                        raise error from exc
                    await self.report_failure(hop, error)
                    await self.backoff(attempt)
                    attempt, refresh = attempt + 1, True
                    break
                hop_records = [HopRecord(hop, hidden, backward_id)]
                if self._draw_check():
                    output, hop_records = await self._spot_check_forward(hop_records[0], output, mask, positions)
                records.extend(hop_records)
                hidden, block = output, hop.end
        self.last_route = [record.hop for record in records]
        return hidden, records

    async def backward(
        self,
        grad: torch.Tensor,
        records: list[HopRecord],
        mask,
        positions,
        training: TrainingTag | None = None,
        done: list | None = None,
    ) -> torch.Tensor:
        """Gradient w.r.t. the inputs of the hops in `records`, given the gradient w.r.t. their last output.

        With `training`, peers add their parameter gradients to their run's next update; `done` then receives
        (hop, inputs, grad) of each hop that answered, so that a trainer can redo the work of a peer that died.
        """
        if records:
            checks.check_grad(grad, tuple(records[-1].inputs.shape))
        for record in reversed(records):
            grad = await self._backward_hop(record, grad, mask, positions, 0, training, done)
        return grad

    async def _backward_hop(
        self,
        record: HopRecord,
        grad,
        mask,
        positions,
        attempt: int,
        training: TrainingTag | None = None,
        done: list | None = None,
    ) -> torch.Tensor:
        hop, inputs = record.hop, record.inputs
        try:
            grad_inputs = await self._call_backward(hop, inputs, grad, mask, positions, record.backward_id, training)
        except Exception as exc:
            error = checks.blame(exc, describe(hop), training=training is not None)
            if not is_retriable(error) or attempt >= self.config.max_retries:
                raise error from exc
            await self.report_failure(hop, error)
            await self.backoff(attempt)
        else:
            if done is not None:
                done.append((hop, inputs, grad))
            if training is None and self._draw_check():
                grad_inputs = await self._spot_check_backward(record, grad, grad_inputs, mask, positions)
            return grad_inputs
        # any peers of these blocks recompute the same function: re-run their forward for their inputs
        _, records = await self.forward(inputs, mask, positions, hop.start, hop.end, keep_for_backward=True)
        for record in reversed(records):
            grad = await self._backward_hop(record, grad, mask, positions, attempt + 1, training, done)
        return grad

    # --- spot checks (client/verify.py) ---

    def _draw_check(self) -> bool:
        # a training run's peers change their weights as it goes: two of them agree only at the same epoch
        return self.run_id is None and self.spot_checks.draw()

    def _ban_wrong_result(self, peer_id: str, at_least_s: float) -> float:
        self.rtts.pop(peer_id, None)
        self.paths.pop(peer_id, None)
        return self.bans.ban(peer_id, at_least_s)

    async def _route_for_check(self, start: int, end: int, excluded: frozenset[str]) -> list[RouteHop] | None:
        """A route over blocks [start, end) avoiding `excluded`, now (no waiting); None if there is none."""
        try:
            snapshot = await self.snapshot()
            hops = plan_forward_route(
                snapshot,
                start,
                end,
                banned=self.bans.banned(snapshot.expirations) | excluded,
                rng=self.spot_checks.rng,
                model_name=self.prefix,
            )
        except SwarmError as exc:  # NoPeersError, or the directory could not be read: the caller's work goes on
            logger.debug("no route to check blocks %d:%d on: %s", start, end, exc)
            return None
        await self.measure_rtts(snapshot, only={hop.peer_id for hop in hops})
        return [replace(hop, endpoint=self.paths.get(hop.peer_id, hop.endpoint)) for hop in hops]

    async def _checker_call(self, hop: RouteHop, call: Awaitable[torch.Tensor]) -> torch.Tensor | None:
        """A check's own call: a peer that fails it is banned as usual, and the check is given up (None)."""
        try:
            return await call
        except Exception as exc:
            error = checks.blame(exc, describe(hop))
            if not isinstance(error, SwarmError):
                raise
            await self.report_failure(hop, error)
            return None

    def _computed(self, value: torch.Tensor, route: list[RouteHop], records: list | None = None) -> Computed:
        return Computed(
            value, tuple(hop.peer_id for hop in route), tuple(self.hop_dtype(hop) for hop in route), records or []
        )

    async def _spot_check_forward(
        self, record: HopRecord, output: torch.Tensor, mask, positions
    ) -> tuple[torch.Tensor, list[HopRecord]]:
        """`record`'s hop computed again elsewhere; the output to use and the records of the route it came from."""
        hop = record.hop

        async def forward(other: RouteHop, hidden: torch.Tensor) -> torch.Tensor | None:
            return await self._checker_call(other, self._call_forward(other, hidden, mask, positions, ""))

        async def recompute(excluded: frozenset[str]) -> Computed | None:
            route = await self._route_for_check(hop.start, hop.end, excluded)
            done = None if route is None else await verify.forward_on(route, record.inputs, forward)
            return None if done is None else self._computed(done[0], route, [HopRecord(*sent) for sent in done[1]])

        chosen = await self.spot_checks.check(
            "forward", (hop.start, hop.end), self._computed(output, [hop], [record]), recompute
        )
        return chosen.value, chosen.records

    async def _spot_check_backward(
        self, record: HopRecord, grad: torch.Tensor, grad_inputs: torch.Tensor, mask, positions
    ) -> torch.Tensor:
        """`record`'s backward computed again elsewhere; the gradient to use."""
        hop = record.hop

        async def forward(other: RouteHop, hidden: torch.Tensor) -> torch.Tensor | None:
            return await self._checker_call(other, self._call_forward(other, hidden, mask, positions, ""))

        async def backward(other: RouteHop, hidden: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
            return await self._checker_call(other, self._call_backward(other, hidden, grad_out, mask, positions, ""))

        async def recompute(excluded: frozenset[str]) -> Computed | None:
            route = await self._route_for_check(hop.start, hop.end, excluded)
            done = None if route is None else await verify.backward_on(route, record.inputs, grad, forward, backward)
            return None if done is None else self._computed(done, route)

        chosen = await self.spot_checks.check(
            "backward", (hop.start, hop.end), self._computed(grad_inputs, [hop]), recompute
        )
        return chosen.value

    async def close(self) -> None:
        await self.pool.close()
        if self._p2p is not None:  # its tasks live on this loop: end them before the loop does
            await self._p2p.shutdown()


class RemoteBlocks(torch.autograd.Function):
    """Autograd over the remote blocks: gradients flow back through the peers' backward RPCs."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, mask, positions, sequence: RemoteSequence, run) -> torch.Tensor:
        # only a forward whose backward will come asks the peers to keep activations for it
        keep = ctx.needs_input_grad[0]
        output, records = run(sequence.forward(hidden.detach(), mask, positions, keep_for_backward=keep))
        ctx.sequence, ctx.run, ctx.records, ctx.mask, ctx.positions = sequence, run, records, mask, positions
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_inputs = ctx.run(ctx.sequence.backward(grad.contiguous(), ctx.records, ctx.mask, ctx.positions))
        return grad_inputs, None, None, None, None
