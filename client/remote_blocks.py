"""Autograd over a model's remote blocks (RemoteBlocks): a forward through client/sequence.py's RemoteSequence, whose
backward sends the gradient back through the same peers."""

from __future__ import annotations

import torch

from client.sequence import RemoteSequence
from swarm.models.routers import MoeLayout, RouterTotals


class RemoteBlocks(torch.autograd.Function):
    """Autograd over the remote blocks: gradients flow back through the peers' backward RPCs.

    With `routers` (a mixture-of-experts model's layout) it also returns the hops' router sums added up
    (swarm/models/routers.py): probabilities per expert, which carry a gradient back to every hop, then picks per
    expert and rows, which do not.
    """

    @staticmethod
    def forward(
        ctx, hidden: torch.Tensor, mask, positions, sequence: RemoteSequence, run, routers: MoeLayout | None = None
    ):
        # only a forward whose backward will come asks the peers to keep activations for it
        keep = ctx.needs_input_grad[0]
        output, records = run(
            sequence.forward(hidden.detach(), mask, positions, keep_for_backward=keep, routers=routers)
        )
        ctx.sequence, ctx.run, ctx.records, ctx.mask, ctx.positions = sequence, run, records, mask, positions
        if routers is None:
            return output
        totals = RouterTotals.add([part for r in records for part in r.router or ()], routers.experts)
        counts, rows = totals.counts, torch.tensor(totals.rows, dtype=torch.float64)
        ctx.mark_non_differentiable(counts, rows)
        return output, totals.probs, counts, rows

    @staticmethod
    def backward(ctx, grad: torch.Tensor, grad_probs: torch.Tensor | None = None, *_):
        router_grad = tuple(grad_probs.tolist()) if grad_probs is not None and bool(grad_probs.any()) else ()
        grad_inputs = ctx.run(
            ctx.sequence.backward(grad.contiguous(), ctx.records, ctx.mask, ctx.positions, router_grad=router_grad)
        )
        return grad_inputs, None, None, None, None, None
