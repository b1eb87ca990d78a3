"""The remote blocks of one model: forward and backward over chains of peers (autograd over them: client/remote_blocks.py).

A failed peer is banned for a while (client/bans.py), the directory is refreshed at once, and the failed part of
the chain is routed to other peers (client/retry.py: the rule every request here and in client/session.py
follows). A peer fails when it cannot be reached, or answers with an error or with anything but what was asked for
(client/checks.py: every answer is checked, and input is checked here before it is sent, so that only the caller's
bad input fails immediately). Routes are planned on a cached directory (client/routing.py) and sent where each
peer's ping answered (client/dialing.py).

A random share of forward and backward hops (`verify_fraction`) is recomputed on other peers: the answer of a
peer outvoted two to one is replaced, and the peer banned where a fourth route confirms it (client/verify.py
decides, client/hop_checks.py runs the checks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import hivemind
import torch

from client import checks
from client.adapters import serving_adapter
from client.bans import BanList
from client.config import ClientConfig
from client.dialing import Dialer
from client.hop_checks import HopChecks
from client.hops import HopRecord, RouterReport, TakenBackward, TrainingTag
from client.retry import Attempts, describe
from client.routing import RouteHop, plan_forward_route, plan_inference_route
from client.speeds import Speeds
from client.splitting import route_caps, row_chunks
from client.transport import ChannelPool
from client.verify import SpotChecker
from protocol import swarmlm_pb2 as pb
from protocol.codec import parse_dtype
from protocol.errors import NoPeersError
from protocol.packing import Packer
from protocol.records import ServerInfo
from swarm.dht.directory import fetch_snapshot
from swarm.dht.snapshot import SwarmSnapshot
from swarm.models.adapters import folder_digest
from swarm.models.routers import MoeLayout
from swarm.net.tunnel import TunnelPool, is_tunnel

logger = logging.getLogger(__name__)


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
        pool: ChannelPool | None = None,
        directory: Callable[[str, int], SwarmSnapshot] | None = None,
    ):
        """`pool` reaches the peers and `directory(prefix, num_blocks)` reads who serves what (blocking; it runs in a
        thread); by default gRPC channels, and `fetch_snapshot` on `dht`. Tests pass in-memory peers instead
        (tests/helpers/fake_swarm.py)."""
        self.dht, self.prefix, self.num_blocks, self.config = dht, prefix, num_blocks, config
        self.run_id = run_id  # when set, only peers that train this run are used
        # peers not to route to whatever their record says (a trainer's stage members that are behind or fenced)
        self.avoid: frozenset[str] = frozenset()
        # how tensors travel to and from the peers (pb.Compression)
        self.compression = pb.Compression.Value(config.wire_dtype.upper())
        # the model's, to check inputs as the peers will (None: not checked here)
        self.hidden_size, self.max_positions = hidden_size, max_positions
        self._p2p: hivemind.P2P | None = None
        if pool is None:
            pool = ChannelPool(
                config.max_message_bytes,
                TunnelPool(self.p2p),
                max_channels=config.max_channels,
                swarm_key=config.swarm_key,
            )
        self.pool = pool
        self.directory = directory if directory is not None else functools.partial(fetch_snapshot, dht)
        self.bans = BanList(base_s=max(config.retry_delay_s * 4, 1.0))
        self._snapshot: SwarmSnapshot | None = None
        self.other_weights: Counter[str] = Counter()  # quantization -> ONLINE peers of it left out, at the last read
        self._snapshot_at = 0.0
        self.failovers = 0  # peer failures seen (each one bans the peer and re-routes)
        self.recoveries = 0  # spans of inference sessions re-routed and replayed after them
        self.recovery_s = 0.0  # time inference sessions spent recovering from them
        self.dialer = Dialer(self.pool, self.bans)
        self.speeds = Speeds()  # what forward calls and inference steps measured of each peer: caps what peers announce
        self.last_route: list[RouteHop] = []  # hops of the latest forward, for diagnostics
        # the adapter's digest that peers must announce (None: the most announced, client/adapters.py)
        self.adapter_digest = folder_digest(config.adapter_path, config.adapter) if config.adapter_path else None
        self.spot_checks = SpotChecker(
            config.verify_fraction, self._ban_wrong_result, random.Random(config.verify_seed)
        )
        self.hop_checks = HopChecks(self)

    def span(self, hop: RouteHop) -> pb.Span:
        """What a request to `hop` asks for: its blocks of this model, with this client's adapter."""
        return pb.Span(model=self.prefix, start=hop.start, end=hop.end, adapter=self.config.adapter or "")

    @property
    def paths(self) -> dict[str, str]:
        """Peer id -> the address its ping answered on (`Dialer.paths`)."""
        return self.dialer.paths

    async def address_of(self, peer_id: str, info: ServerInfo, timeout_s: float = 1.0) -> str:
        """Where to send `peer_id`'s requests: the path its ping answered on, found now if it is not known."""
        return await self.dialer.address_of(peer_id, info, self._snapshot, timeout_s)

    def attempts(self, count: int = 0) -> Attempts:
        """A new request's tries against peer failures (client/retry.py), `count` of them used already."""
        return Attempts(
            max_retries=self.config.max_retries,
            retry_delay_s=self.config.retry_delay_s,
            report=self.report_failure,
            count=count,
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
            snapshot = await asyncio.to_thread(self.directory, self.prefix, self.num_blocks)
            wanted = self.config.quantization
            # peers of another run, or holding other weights, compute something else: never routed to or compared
            self.other_weights = Counter(
                info.quantization for info in snapshot.online().values() if info.quantization != wanted
            )
            servers = {
                pid: info
                for pid, info in snapshot.servers.items()
                if info.quantization == wanted and (self.run_id is None or info.run_id == self.run_id)
            }
            if self.config.adapter is not None:  # peers of another adapter, or none, compute something else too
                servers = serving_adapter(servers, self.config.adapter, self.adapter_digest)
            snapshot = replace(snapshot, servers=servers)
            self._snapshot = snapshot
            self._snapshot_at = time.monotonic()
            self.bans.observe(self._snapshot.expirations, read_at=began)
        return self._snapshot

    async def plan(
        self,
        start: int,
        end: int,
        *,
        inference: bool,
        min_cache_tokens: int = 0,
        refresh: bool = False,
        avoid: frozenset[str] = frozenset(),
    ) -> list[RouteHop]:
        """A route for blocks [start, end), not through `avoid`; waits up to `wait_for_peers_s` for the swarm to
        cover them."""
        deadline = time.monotonic() + self.config.wait_for_peers_s
        delay = self.config.retry_delay_s
        waiting_for = ""
        while True:
            snapshot = await self.snapshot(refresh=refresh)
            try:
                # every peer that may serve the range is pinged first (once; a peer that answers no ping, or
                # proves another key, is then left out, unless the range has no other)
                await self.dialer.measure_rtts(
                    snapshot, only=None if inference else self._serving(snapshot, start, end)
                )
                banned = self.bans.banned(snapshot.expirations) | self.avoid | avoid
                snapshot = self.speeds.capped(snapshot)
                try:
                    hops = self._route(
                        snapshot, start, end, inference, banned | self.dialer.unreachable(), min_cache_tokens
                    )
                except NoPeersError:
                    hops = self._route(snapshot, start, end, inference, banned, min_cache_tokens)
                return self.dialer.on_paths(hops)
            except NoPeersError as exc:
                if time.monotonic() + delay > deadline:
                    if self.other_weights:
                        found = sorted(self.other_weights.items())
                        others = ", ".join(f"{n} hold {q} weights" for q, n in found)
                        ways = " or ".join(f"quantization={q!r} (swarmlm api --quantization {q})" for q, _ in found)
                        raise NoPeersError(
                            f"{exc}; of the peers left out because their weights are not {self.config.quantization} "
                            f"as this client asks, {others}: pass {ways} to use them"
                        ) from exc
                    if self.config.adapter is not None:
                        raise NoPeersError(
                            f"{exc}; this client uses only peers serving adapter {self.config.adapter!r} "
                            f"(swarmlm peer --adapters {self.config.adapter}=DIR)"
                        ) from exc
                    raise
                if str(exc) != waiting_for:  # once per change of what is missing, not every retry
                    waiting_for = str(exc)
                    logger.info("waiting up to %.0f s more for peers: %s", deadline - time.monotonic(), exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            refresh = True

    def _route(
        self, snapshot: SwarmSnapshot, start: int, end: int, inference: bool, banned: set[str], min_cache_tokens: int
    ) -> list[RouteHop]:
        if inference:
            return plan_inference_route(
                snapshot,
                start,
                end,
                client_rtt_s=self.dialer.rtts,
                banned=banned,
                min_cache_tokens=min_cache_tokens,
                model_name=self.prefix,
            )
        return plan_forward_route(snapshot, start, end, banned=banned, model_name=self.prefix)

    @staticmethod
    def _serving(snapshot: SwarmSnapshot, start: int, end: int) -> set[str]:
        """The ONLINE peers that serve some of blocks [start, end)."""
        return {pid for pid, info in snapshot.online().items() if info.start_block < end and info.end_block > start}

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
        self.dialer.forget(hop.peer_id)
        self.failovers += 1
        await self.pool.drop(hop.endpoint)

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

    def caps(self, hops) -> tuple[int, int]:
        """What every peer of `hops` takes in one request, as their records say (client/splitting.py)."""
        servers = self._snapshot.servers if self._snapshot else {}
        return route_caps(servers.get(hop.peer_id) for hop in hops)

    async def _call_forward(
        self, hop: RouteHop, hidden, mask, positions, backward_id: str, routers: RouterReport | None = None
    ) -> torch.Tensor:
        """One hop's forward, in pieces of rows where the whole would exceed the peer's caps (nothing is then kept
        for the backward, which recomputes). `routers`: where to add the router sums each answer reports."""
        batch, length = hidden.shape[:2]
        caps = self.caps([hop])
        if batch * length <= caps[0] and batch * length * length <= caps[1]:
            return await self._forward_request(hop, hidden, mask, positions, backward_id, routers)
        pieces = []
        for begin, end in row_chunks(batch, length, caps):
            rows = _rows(begin, end, batch, mask, positions)
            pieces.append(await self._forward_request(hop, hidden[begin:end], *rows, "", routers))
        return torch.cat(pieces)

    async def _forward_request(
        self, hop: RouteHop, hidden, mask, positions, backward_id: str, routers: RouterReport | None = None
    ) -> torch.Tensor:
        dtype = self.hop_dtype(hop)
        packer = Packer()
        request = packer.pack(
            pb.ForwardRequest(
                span=self.span(hop),
                hidden_states=packer.tensor(hidden.to(dtype), self.compression),
                attention_mask=packer.optional(mask),
                position_ids=packer.optional(positions),
                backward_id=backward_id,
                output_compression=self.compression,
                router_stats=routers is not None,
            )
        )
        checks.check_size(request, self.config.max_message_bytes)
        began = time.perf_counter()
        response = await self.pool.unary(hop.endpoint, "forward", request, self.config.request_timeout_s)
        took = time.perf_counter() - began
        output = checks.unary_answer(response, "hidden_states", peer=describe(hop), shape=hidden.shape, dtype=dtype)
        if routers is not None:
            tokens = float(mask.sum()) if mask is not None else hidden.shape[0] * hidden.shape[1]
            rows = tokens * routers.moe.routed_in(hop.start, hop.end)
            routers.parts.append(checks.router_answer(response, peer=describe(hop), moe=routers.moe, rows=rows))
        info = self._snapshot.servers.get(hop.peer_id) if self._snapshot else None
        if info is not None:  # as announced: tokens a second through its whole span, a hop over part of it faster
            part = (hop.end - hop.start) / (info.end_block - info.start_block)
            self.speeds.record(hop.peer_id, hidden.shape[0] * hidden.shape[1], took / part)
        return output.to(hidden.dtype)

    async def _call_backward(
        self,
        hop: RouteHop,
        inputs,
        grad,
        mask,
        positions,
        backward_id: str,
        training: TrainingTag | None = None,
        router_grad: tuple[float, ...] = (),
    ) -> torch.Tensor:
        """One hop's backward, in pieces of rows where the whole would exceed the peer's caps (not a training
        step's: a micro-batch counts once, whole, and the trainer sizes it). `router_grad`: the loss's gradient
        w.r.t. the hop's router sums, per expert (swarm/models/routers.py), for every piece alike."""
        batch, length = inputs.shape[:2]
        caps = self.caps([hop])
        if training is not None or (batch * length <= caps[0] and batch * length * length <= caps[1]):
            return await self._backward_request(hop, inputs, grad, mask, positions, backward_id, training, router_grad)
        pieces = []
        for begin, end in row_chunks(batch, length, caps):
            rows = _rows(begin, end, batch, mask, positions)
            pieces.append(
                await self._backward_request(hop, inputs[begin:end], grad[begin:end], *rows, "", None, router_grad)
            )
        return torch.cat(pieces)

    async def _backward_request(
        self,
        hop: RouteHop,
        inputs,
        grad,
        mask,
        positions,
        backward_id: str,
        training: TrainingTag | None,
        router_grad: tuple[float, ...] = (),
    ) -> torch.Tensor:
        dtype = self.hop_dtype(hop)
        packer = Packer()
        run_id, epoch = (training.run_id, training.epochs.get((hop.start, hop.end), 0)) if training else ("", 0)
        request = packer.pack(
            pb.BackwardRequest(
                run_id=run_id,
                epoch=epoch,
                span=self.span(hop),
                hidden_states=packer.tensor(inputs.to(dtype), self.compression),
                grad_outputs=packer.tensor(grad.to(dtype), self.compression),
                attention_mask=packer.optional(mask),
                position_ids=packer.optional(positions),
                backward_id=backward_id,
                output_compression=self.compression,
                micro_batch=pb.MicroBatch(
                    trainer=training.micro_batch[0], index=training.micro_batch[1], samples=training.micro_batch[2]
                )
                if training is not None and training.micro_batch is not None
                else None,
                router_grad=router_grad,
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
        routers: MoeLayout | None = None,
    ) -> tuple[torch.Tensor, list[HopRecord]]:
        """Run blocks [start, end); return the outputs and what each hop was sent (for backward).

        With `keep_for_backward`, peers are asked to keep their activations until the backward, which then
        need not recompute the forward. With `routers` (a mixture-of-experts model's layout), each hop's record also
        holds the router sums its peer reported (swarm/models/routers.py).

        Raises:
            BadRequestError: the inputs are not what a peer accepts (nothing was sent).
            NoPeersError: nobody serves some of the blocks.
            SwarmError: peers kept failing (`max_retries` route changes), e.g. PeerFaultError.
        """
        self.check_inputs(hidden, mask, positions)
        end = self.num_blocks if end is None else end
        records: list[HopRecord] = []
        block, attempts, refresh = start, self.attempts(), False
        while block < end:
            route = await self.plan(block, end, inference=False, refresh=refresh)
            for hop in route:
                backward_id = uuid.uuid4().hex if keep_for_backward else ""
                row_chunks(*hidden.shape[:2], self.caps([hop]))  # a row over the caps is ours to shorten, not a fault
                report = RouterReport(routers) if routers is not None else None
                try:
                    output = await self._call_forward(hop, hidden, mask, positions, backward_id, report)
                except Exception as exc:
                    error = await attempts.failed(exc, hop)
                    if error is not None:
                        raise error from exc
                    await attempts.backoff()
                    refresh = True
                    break
                hop_records = [HopRecord(hop, hidden, backward_id, report.parts if report is not None else None)]
                if self._draw_check():
                    output, hop_records = await self.hop_checks.forward(hop_records[0], output, mask, positions)
                    if routers is not None:  # replaced by another route's answer: take that route's sums
                        hop_records = [await self._with_routers(r, mask, positions, routers) for r in hop_records]
                records.extend(hop_records)
                hidden, block = output, hop.end
        self.last_route = [record.hop for record in records]
        return hidden, records

    async def _with_routers(self, record: HopRecord, mask, positions, routers: MoeLayout) -> HopRecord:
        """`record` with its hop's router sums, asked again of its peer where the record has none."""
        if record.router is not None:
            return record
        report = RouterReport(routers)
        await self._call_forward(record.hop, record.inputs, mask, positions, "", report)
        return replace(record, router=report.parts)

    async def backward(
        self,
        grad: torch.Tensor,
        records: list[HopRecord],
        mask,
        positions,
        training: TrainingTag | None = None,
        done: list[TakenBackward] | None = None,
        router_grad: tuple[float, ...] = (),
    ) -> torch.Tensor:
        """Gradient w.r.t. the inputs of the hops in `records`, given the gradient w.r.t. their last output (and,
        for a mixture-of-experts loss, `router_grad`: w.r.t. the router sums of every hop, per expert).

        With `training`, peers add their parameter gradients to their run's next update; `done` then receives
        a TakenBackward for each hop that answered, so that a trainer can redo the work of a peer that died.
        """
        if records:
            checks.check_grad(grad, tuple(records[-1].inputs.shape))
        for record in reversed(records):
            grad = await self._backward_hop(record, grad, mask, positions, 0, training, done, router_grad)
        return grad

    async def _backward_hop(
        self,
        record: HopRecord,
        grad,
        mask,
        positions,
        attempt: int,
        training: TrainingTag | None = None,
        done: list[TakenBackward] | None = None,
        router_grad: tuple[float, ...] = (),
    ) -> torch.Tensor:
        hop, inputs = record.hop, record.inputs
        attempts = self.attempts(attempt)  # each re-routed hop's backward counts from its depth of re-routing
        if training is None:
            row_chunks(*inputs.shape[:2], self.caps([hop]))  # as in forward: ours to shorten
        try:
            grad_inputs = await self._call_backward(
                hop, inputs, grad, mask, positions, record.backward_id, training, router_grad
            )
        except Exception as exc:
            error = await attempts.failed(exc, hop, training=training is not None)
            if error is not None:
                raise error from exc
            await attempts.backoff()
        else:
            if done is not None:
                done.append(TakenBackward(hop, inputs, grad, router_grad))
            if training is None and self._draw_check():
                grad_inputs = await self.hop_checks.backward(record, grad, grad_inputs, mask, positions, router_grad)
            return grad_inputs
        # any peers of these blocks recompute the same function: re-run their forward for their inputs
        _, records = await self.forward(inputs, mask, positions, hop.start, hop.end, keep_for_backward=True)
        for record in reversed(records):
            grad = await self._backward_hop(record, grad, mask, positions, attempts.count, training, done, router_grad)
        return grad

    # --- spot checks (client/verify.py decides, client/hop_checks.py runs them) ---

    def _draw_check(self) -> bool:
        # a training run's peers change their weights as it goes: two of them agree only at the same epoch
        return self.run_id is None and self.spot_checks.draw()

    def _ban_wrong_result(self, peer_id: str, at_least_s: float) -> float:
        self.dialer.forget(peer_id)
        self.speeds.forget(peer_id)
        return self.bans.ban(peer_id, at_least_s)

    async def check_inference(self, hop: RouteHop, inputs: torch.Tensor, outputs: torch.Tensor, mask, positions):
        """Whether `hop`'s answers to an inference session stand: a client/hop_checks.py `Verdict`."""
        return await self.hop_checks.inference(hop, inputs, outputs, mask, positions)

    async def close(self) -> None:
        await self.pool.close()
        if self._p2p is not None:  # its tasks live on this loop: end them before the loop does
            await self._p2p.shutdown()


def _rows(begin: int, end: int, batch: int, mask, positions) -> tuple:
    """The mask and positions of rows [begin, end) of a batch (positions of one row serve every row)."""
    mask = mask[begin:end] if mask is not None else None
    if positions is not None and positions.shape[0] == batch and batch > 1:
        positions = positions[begin:end]
    return mask, positions
