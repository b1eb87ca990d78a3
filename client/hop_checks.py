"""Spot checks of a sequence's hops, run: a hop's forward, its backward, or an inference span's answers so far,
computed again over other routes of the same blocks (client/verify.py decides whom to believe and whom to ban).

A check's own calls go through the sequence like any call (its peers' caps, its adapter, its wire dtype); a peer
that fails one is banned as usual, and the check is given up rather than the caller's work.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from client import verify
from client.hops import HopRecord
from client.retry import blame, is_retriable
from client.routing import RouteHop, plan_forward_route
from client.verify import Computed
from protocol.errors import SwarmError

if TYPE_CHECKING:
    from client.sequence import RemoteSequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """What a check of an inference span's answers found."""

    stands: bool | None
    """True: another route agreed; False: its peer was outvoted; None: not verified (no other route answered, or
    no majority formed)."""
    peers: tuple[str, ...] = ()
    """Stands: the peers of the route that agreed with it."""
    first_wrong: int | None = None
    """Outvoted: the first position at which its answers differ from the majority's."""


class HopChecks:
    """The spot checks of one RemoteSequence."""

    def __init__(self, sequence: RemoteSequence):
        self.sequence = sequence

    async def _route(self, start: int, end: int, excluded: frozenset[str]) -> list[RouteHop] | None:
        """A route over blocks [start, end) avoiding `excluded`, now (no waiting); None if there is none."""
        seq = self.sequence
        try:
            snapshot = await seq.snapshot()
            await seq.dialer.measure_rtts(snapshot, only=seq._serving(snapshot, start, end))
            hops = plan_forward_route(
                snapshot,
                start,
                end,
                banned=seq.bans.banned(snapshot.expirations) | seq.avoid | excluded | seq.dialer.unreachable(),
                rng=seq.spot_checks.rng,
                model_name=seq.prefix,
                uniform=True,
            )
        except SwarmError as exc:  # NoPeersError, or the directory could not be read: the caller's work goes on
            logger.debug("no route to check blocks %d:%d on: %s", start, end, exc)
            return None
        return seq.dialer.on_paths(hops)

    async def _call(self, hop: RouteHop, call: Awaitable[torch.Tensor]) -> torch.Tensor | None:
        """A check's own call: a peer that fails it is banned as usual, and the check is given up (None)."""
        try:
            return await call
        except Exception as exc:
            # blamed outside training, any SwarmError is the peer's fault (so it is reported); anything else is ours
            if not is_retriable(await blame(exc, hop, self.sequence.report_failure)):
                raise
            return None

    def _computed(self, value: torch.Tensor, route: list[RouteHop], records: list | None = None) -> Computed:
        dtypes = tuple(self.sequence.hop_dtype(hop) for hop in route)
        return Computed(value, tuple(hop.peer_id for hop in route), dtypes, records or [])

    async def forward(
        self, record: HopRecord, output: torch.Tensor, mask, positions
    ) -> tuple[torch.Tensor, list[HopRecord]]:
        """`record`'s hop computed again elsewhere; the output to use and the records of the route it came from."""
        hop, seq = record.hop, self.sequence

        async def forward(other: RouteHop, hidden: torch.Tensor) -> torch.Tensor | None:
            return await self._call(other, seq._call_forward(other, hidden, mask, positions, ""))

        async def recompute(excluded: frozenset[str]) -> Computed | None:
            route = await self._route(hop.start, hop.end, excluded)
            done = None if route is None else await verify.forward_on(route, record.inputs, forward)
            return None if done is None else self._computed(done[0], route, [HopRecord(*sent) for sent in done[1]])

        chosen = await seq.spot_checks.check(
            "forward", (hop.start, hop.end), self._computed(output, [hop], [record]), recompute
        )
        return chosen.value, chosen.records

    async def backward(
        self, record: HopRecord, grad: torch.Tensor, grad_inputs: torch.Tensor, mask, positions, router_grad=()
    ) -> torch.Tensor:
        """`record`'s backward computed again elsewhere (with the same `router_grad`); the gradient to use."""
        hop, seq = record.hop, self.sequence

        async def forward(other: RouteHop, hidden: torch.Tensor) -> torch.Tensor | None:
            return await self._call(other, seq._call_forward(other, hidden, mask, positions, ""))

        async def backward(other: RouteHop, hidden: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
            return await self._call(
                other, seq._call_backward(other, hidden, grad_out, mask, positions, "", router_grad=router_grad)
            )

        async def recompute(excluded: frozenset[str]) -> Computed | None:
            route = await self._route(hop.start, hop.end, excluded)
            done = None if route is None else await verify.backward_on(route, record.inputs, grad, forward, backward)
            return None if done is None else self._computed(done, route)

        chosen = await seq.spot_checks.check(
            "backward", (hop.start, hop.end), self._computed(grad_inputs, [hop]), recompute
        )
        return chosen.value

    async def inference(self, hop: RouteHop, inputs: torch.Tensor, outputs: torch.Tensor, mask, positions) -> Verdict:
        """Whether `hop`'s answers to an inference session stand: its `outputs` at every position of the session's
        `inputs` so far, against other peers' forward of those inputs (client/inference_checks.py). Outvoted two to
        one (and its peer banned if a fourth route confirmed it), the verdict says from which position on its
        answers were wrong, which may be before the positions an earlier check confirmed: that check's route agreed
        with a lie."""
        made: list[Computed | None] = []
        seq = self.sequence

        async def forward(other: RouteHop, hidden: torch.Tensor) -> torch.Tensor | None:
            return await self._call(other, seq._call_forward(other, hidden, mask, positions, ""))

        async def recompute(excluded: frozenset[str]) -> Computed | None:
            route = await self._route(hop.start, hop.end, excluded)
            done = None if route is None else await verify.forward_on(route, inputs, forward)
            made.append(None if done is None else self._computed(done[0], route))
            return made[-1]

        first = self._computed(outputs, [hop])
        chosen = await seq.spot_checks.check("inference", (hop.start, hop.end), first, recompute)
        if chosen is not first:
            rtol = verify.rtol_for(*first.dtypes, *chosen.dtypes, first.value.dtype, chosen.value.dtype)
            wrong = verify.first_disagreement(outputs, chosen.value, rtol)
            return Verdict(False, first_wrong=0 if wrong is None else wrong)
        if len(made) == 1 and made[0] is not None:
            return Verdict(True, peers=made[0].peers)
        return Verdict(None)
