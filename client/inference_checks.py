"""Verified generation: a session's inference steps checked against other peers' prefill of the same history.

A peer answers an inference step from its KV cache, so no other peer can recompute one step alone. But the client
keeps what it sent each span (to replay it after a failure) and what each span answered, and a route of other
peers over the same blocks computes the span's whole input history in one forward: a prefill, cheap next to the
steps that decoded it. So, with probability `ClientConfig.verify_inference` after a step, one span of the route
(drawn uniformly among those with positions not yet verified) is checked: the other route's outputs are compared
with the span's answers at every position, with client/verify.py's per-element tolerance, uniformly drawn checkers
and two-against-one vote. A peer outvoted two to one is banned for an hour only where a fourth route confirms
the majority; otherwise it is set aside for the session, not banned. With no third route, or no majority, nobody
is outvoted.

Decoding does not wait for a check: one runs at a time, beside the steps. When it outvoted a peer, the session's
next step rewinds (InferenceSession.rewind): every span's cache is cut back to the first position at which the
liar's answers differ from the majority's, the liar's span is routed to other peers and its history replayed there,
and the step raises OutputRewoundError naming that position. That position can come before what an earlier check
confirmed: the lone peer of that check agreed with a lie, so it is a colluder, and it is set aside with the liar
(rewinding only to what was confirmed kept the colluders' lie in the text and in the caches of later spans).
`generate()` then starts again from its prompt on the caches kept (client/model.py), and waits for the last check
(`settle`) before it returns, making then the checks that steps decoded meanwhile, or a failed check, were owed (a
draw per span): a liar on the path costs a redo, not wrong text.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from client.session import InferenceSession, SpanSession

logger = logging.getLogger(__name__)


class InferenceChecks:
    """The checks of one inference session: `after_step` may start one, `caught` says whether it found a liar."""

    def __init__(self, rate: float, rng: random.Random):
        self.rate, self.rng = rate, rng
        self.task: asyncio.Task | None = None
        self.found: SpanSession | None = None  # the span whose peer a check caught, until the session rewinds
        self.colluders: set[str] = set()  # peers whose checks confirmed answers a later check outvoted
        self.started = 0  # checks started
        self.caught = 0  # of those, checks that found a liar
        # a step came while a check ran (it got no draw of its own), or a check failed: settle() makes up for it
        self.owed = False

    def after_step(self, session: InferenceSession) -> None:
        """Maybe start a check of one span's answers so far (not while another runs); never fails the step."""
        try:
            self._maybe_start(session)
        except Exception:  # a bug of ours must not cost the caller its step
            logger.exception("could not start a check of an inference session")

    def _maybe_start(self, session: InferenceSession, spans: list[SpanSession] | None = None) -> None:
        """Maybe start a check of one of `spans` (default: the session's) that has unverified positions."""
        running = self.task is not None and not self.task.done()
        if self.rate > 0 and running:
            self.owed = True
        if self.rate <= 0 or running or self.found is not None or self.rng.random() >= self.rate:
            return
        candidates = [span for span in spans or session.spans if span.verified < session.position and span.outputs]
        if not candidates:
            return
        span = self.rng.choice(candidates)
        position = session.position
        # copies of the history as it is now: the session goes on (and may be cut back) while the check runs
        inputs, outputs = torch.cat(span.inputs, dim=1), torch.cat(span.outputs, dim=1)
        positions = torch.cat(span.positions, dim=1)
        if inputs.shape[1] != position or outputs.shape[1] != position:
            return  # a history not kept whole (cannot happen while spans keep every step): nothing to compare
        mask = session.mask[:, :position] if session.mask is not None else None
        self.started += 1
        self.owed = False  # this check covers every step so far
        self.task = asyncio.ensure_future(self._check(session, span, inputs, outputs, mask, positions, position))

    async def _check(self, session, span: SpanSession, inputs, outputs, mask, positions, position: int) -> None:
        try:
            verdict = await session.sequence.check_inference(span.hop, inputs, outputs, mask, positions)
        except Exception as exc:  # a check that cannot be made leaves the answers as they are, unverified
            logger.warning(
                "could not check blocks %d:%d of an inference session: %s", span.hop.start, span.hop.end, exc
            )
            self.owed = True
            return
        if verdict.stands is None:  # no other route answered, or none formed a majority: still to verify
            self.owed = True
        elif verdict.stands:
            span.verified = max(span.verified, position)
            span.confirmed.append((position, verdict.peers))
        else:
            self.caught += 1
            if verdict.first_wrong < span.verified:
                # a check had confirmed wrong answers: its lone peer agreed with the liar's lie (a colluder)
                self.colluders |= {
                    peers[0] for upto, peers in span.confirmed if upto > verdict.first_wrong and len(peers) == 1
                }
            span.verified = min(span.verified, verdict.first_wrong)
            self.found = span

    def liar(self) -> SpanSession | None:
        """The span whose peer a finished check caught computing wrong results (once), else None; does not wait."""
        found, self.found = self.found, None
        return found

    async def settle(self, session: InferenceSession) -> SpanSession | None:
        """`liar()`, after waiting for the check that runs, if one does, and then for those it owes: when steps came
        while a check ran, or a check verified nothing, each span with unverified positions gets a draw now, one
        span after the other (a check verifies one span; the session's position no longer grows). Otherwise, with
        checks slower than steps, the last steps of a generation would stay unverified."""
        await self._wait()
        if self.owed:
            spans = list(session.spans)
            for span in self.rng.sample(spans, len(spans)):
                self._maybe_start(session, [span])
                await self._wait()
        return self.liar()

    async def _wait(self) -> None:
        if self.task is not None and not self.task.done():
            await asyncio.wait([self.task])

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait([self.task])
        self.task = None
