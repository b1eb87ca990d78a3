"""A trainer's micro-batches through the stages of a run.

Embeddings here, the blocks on one member per stage (forward kept for the backward), loss and head here, then
backward through the stages. Each micro-batch has an id (its trainer, its index); a member adds an id once, so a
backward whose answer was lost goes to the same member again, never to another while the first may hold it
(client/training/ledger.py). A member that is gone is fenced: left out of the update, and every micro-batch it held
sent to another member of its stage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from client import checks
from client.config import TrainConfig
from client.retry import describe
from client.routing import RouteHop
from client.sequence import HopRecord, TakenBackward, TrainingTag
from client.training.ledger import Ledger
from client.training.stages import Span, Stages
from protocol.errors import BadRequestError, TrainingFaultError, UnauthorizedError
from swarm.models.routers import RouterTotals, aux_coefficient, moe_layout

logger = logging.getLogger(__name__)

MAX_WAIT_S = 5.0  # between tries of a backward that a member did not answer


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean next-token cross-entropy over a micro-batch, as transformers computes it with labels=input_ids."""
    return ForCausalLMLoss(logits=logits, labels=ids, vocab_size=vocab_size)


class MicroBatches:
    """Runs one trainer's micro-batches: `model` (its embeddings and head are `params`), `local` runs a function on
    the trainer's thread for local tensors."""

    def __init__(
        self,
        model,
        params: list[torch.nn.Parameter],
        stages: Stages,
        config: TrainConfig,
        trainer_id: str,
        local: Callable[[Callable], Awaitable],
    ):
        self.model, self.params, self.stages, self.config = model, params, stages, config
        self.sequence = model.sequence
        self.trainer_id = trainer_id
        # a mixture-of-experts model whose loss has the load-balancing term: its stages report their router sums
        self.aux_coef = aux_coefficient(model.config, config.router_aux_loss_coef)
        self.moe = moe_layout(model.config) if self.aux_coef else None
        self._local = local

    async def run(
        self,
        index: int,
        ids: torch.Tensor,
        epoch: int,
        ledger: Ledger,
        sums: list[torch.Tensor],
        gate: asyncio.Semaphore,
    ) -> float:
        async with gate:
            model = self.model
            positions = torch.arange(ids.shape[1]).unsqueeze(0)

            def embed():
                with torch.enable_grad():
                    return model.embed(ids)

            hidden = await self._local(embed)
            outputs, records = await self.sequence.forward(
                hidden.detach(), None, positions, keep_for_backward=True, routers=self.moe
            )

            def head():
                with torch.enable_grad():
                    out = outputs.detach().requires_grad_(True)
                    loss = lm_loss(model.head(out), ids, model.config.vocab_size)
                    grads = torch.autograd.grad(loss, [out, *self.params], allow_unused=True)
                return float(loss.detach()), grads[0], grads[1:]

            loss, grad, head_grads = await self._local(head)
            router_grad = ()
            if self.moe is not None:  # the head has no part in it: the stages take its gradient with their backward
                totals = RouterTotals.add([part for r in records for part in r.router or ()], self.moe.experts)
                loss += self.aux_coef * totals.loss()
                router_grad = tuple(totals.prob_grad(self.aux_coef))
            tag = TrainingTag(
                self.config.run_id, dict.fromkeys(ledger.stages, epoch), (self.trainer_id, index, ids.shape[0])
            )
            for record in reversed(records):
                grad = await self._backward_once(record, grad, positions, tag, ledger, router_grad)

            def embed_backward():
                with torch.enable_grad():
                    grads = torch.autograd.grad(hidden, self.params, grad, allow_unused=True)
                for acc, a, b in zip(sums, head_grads, grads):
                    for g in (a, b):
                        if g is not None:
                            acc.add_(g.to(torch.float32), alpha=ids.shape[0])

            await self._local(embed_backward)
            return loss

    async def _backward_once(
        self,
        record: HopRecord,
        grad: torch.Tensor,
        positions,
        tag: TrainingTag,
        ledger: Ledger,
        router_grad: tuple[float, ...] = (),
    ) -> torch.Tensor:
        """The backward of one stage for one micro-batch, added by exactly one member of the stage."""
        hop, backward_id = record.hop, record.backward_id
        span: Span = (hop.start, hop.end)
        _, index, samples = tag.micro_batch
        deadline = time.monotonic() + self.config.step_timeout_s
        attempt = 0
        while True:
            try:
                grad_in = await self.sequence._call_backward(
                    hop, record.inputs, grad, None, positions, backward_id, tag, router_grad
                )
            except Exception as exc:
                error = checks.blame(exc, describe(hop), training=True)
                if isinstance(error, (BadRequestError, UnauthorizedError)):  # ours to fix (StaleEpochError too)
                    raise error from exc
                if await self.stages.lost(hop.peer_id, error):
                    await self.fence(span, hop.peer_id, tag.epochs[span], ledger)
                    hop, backward_id = await self._other_member(span), ""
                    continue
                if time.monotonic() > deadline:
                    raise TrainingFaultError(
                        f"peer {describe(hop)} neither answered micro-batch {index} nor left the swarm within "
                        f"{self.config.step_timeout_s:.0f}s: {error}"
                    ) from exc
                # it may hold the micro-batch: only it may take it again (it adds it once)
                logger.info("peer %s did not answer micro-batch %d (%s); asking it again", describe(hop), index, error)
                await asyncio.sleep(min(0.25 * 2**attempt, MAX_WAIT_S))
                attempt += 1
                continue
            taken = TakenBackward(hop, record.inputs, grad, router_grad)
            if ledger.record(span, hop.peer_id, index, samples, taken):
                return grad_in
            hop, backward_id = await self._other_member(span), ""  # fenced meanwhile: its answer counts for nothing

    async def fence(self, span: Span, peer_id: str, epoch: int, ledger: Ledger) -> None:
        """Leave `peer_id` out of this update and send every micro-batch it held to another member of `span`."""
        moved = ledger.fence(span, peer_id)
        self.sequence.avoid = self.sequence.avoid | {peer_id}
        logger.warning(
            "peer %s (blocks %d:%d) is gone: left out of update %d, its %d micro-batches sent to other members",
            peer_id,
            *span,
            epoch,
            len(moved),
        )
        for index, taken in moved:
            tag = TrainingTag(
                self.config.run_id, {span: epoch}, (self.trainer_id, index, ledger.stages[span].samples[index])
            )
            positions = torch.arange(taken.inputs.shape[1]).unsqueeze(0)
            hop = await self._other_member(span)
            record = HopRecord(hop, taken.inputs, "")
            await self._backward_once(record, taken.grad, positions, tag, ledger, taken.router_grad)

    async def _other_member(self, span: Span) -> RouteHop:
        """A live member of the stage that is not avoided (one hop over the whole span)."""
        hops = await self.sequence.plan(span[0], span[1], inference=False, refresh=True)
        if len(hops) != 1 or (hops[0].start, hops[0].end) != span:
            raise TrainingFaultError(f"no member of stage {span[0]}:{span[1]} is left to take its micro-batches")
        return hops[0]
