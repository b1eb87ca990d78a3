"""gRPC handlers of the Peer service: the unary calls (forward, backward, info, state) here; the inference
stream and the steps pushed into it in peer/inference.py. Both check and compute through peer/served.py.

Every failure of one request becomes a typed error for that request only; the peer and its other sessions
go on. Compute runs on one worker thread so the event loop stays free for the network.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
import torch

from peer import validation
from peer.activations import ActivationStore, Kept
from peer.blocks import BlockSpan
from peer.cache import CacheBudget
from peer.config import ServingLimits
from peer.forwarding import Forwarder
from peer.inference import InferenceStreams, source_of
from peer.proofs import ProofMeter
from peer.served import ServedSpan, as_swarm_error
from peer.state_stream import StateStreams
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_tensor
from protocol.errors import BadRequestError, OverloadedError, SwarmError, WrongSpanError
from protocol.packing import Packer, Received
from protocol.service import ERROR_CODE_KEY, status_for
from swarm.models.routers import RouterStats, check_prob_grad, moe_shape
from swarm.trust.identity import MAX_NONCE_BYTES

if TYPE_CHECKING:
    from peer.training import SpanTraining


class PeerServicer:
    """The Peer service over the span served now: the unary calls, and the inference stream's through `streams`.

    What exists only later is set later: the span once loaded (`set_span`), the training once joined
    (`set_training`).
    """

    def __init__(
        self,
        model_config,
        prefix: str,
        budget: CacheBudget,
        limits: ServingLimits,
        info: Callable[[], pb.InfoResponse],
        *,
        prove: Callable[[bytes], bytes] | None = None,
        forwarder: Forwarder | None = None,
    ):
        """
        Args:
            info: the peer's InfoResponse as of now.
            prove: signs identity nonces with the peer's key (None: Info refuses nonces).
            forwarder: pushes inference steps on to the next peer of a route (None: steps that name one are refused).
        """
        self._info, self._prove = info, prove
        self.proofs = ProofMeter()
        self.served = ServedSpan(model_config, prefix, limits.work)
        self.moe = moe_shape(model_config)  # (experts, top_k) of a mixture-of-experts model
        self.activation_cache_bytes = limits.activation_cache_bytes
        self.activations = ActivationStore(limits.activation_cache_bytes, limits.activation_ttl_s)
        self.training: SpanTraining | None = None
        self.streams = InferenceStreams(self.served, budget, limits, forwarder)
        self.state_streams = StateStreams(lambda fn: self.served.run(fn, tokens=1 << 20), limits.write_timeout_s)

    def set_span(self, span: BlockSpan | None) -> None:
        """Serve `span` from now on (None: serve nothing); sessions of other blocks fail over on their next step."""
        self.served.span = span
        self.activations.clear()  # they belong to the blocks served so far
        # a kept graph holds the weights its forward used: a span that streams blocks in keeps none
        streams = span is not None and span.streamer is not None
        self.activations.max_bytes = 0 if streams else self.activation_cache_bytes

    def set_training(self, training: SpanTraining | None) -> None:
        """Train the span with `training` from now on: backward requests of its run feed it, Info reports it."""
        self.training = training

    def close(self) -> None:
        self.served.close()

    # --- the inference stream (peer/inference.py) ---

    async def inference(self, requests: AsyncIterator[Received], context) -> None:
        await self.streams.inference(requests, context)

    async def push(self, received: Received, context) -> pb.PushResponse:
        """A step pushed by the previous peer of a route into one of this peer's sessions."""

        async def work():
            return self.streams.push(received)

        return await _unary(context, work)

    # --- unary calls ---

    async def forward(self, received: Received, context):
        request: pb.ForwardRequest = received.message

        async def work():
            blocks, adapter = self.served.blocks(request.span), self.served.adapter(request.span)
            hidden, mask, positions = self.served.inputs(request, received.payload)

            span, keep_id = self.served.span, request.backward_id
            routers = self._routers(mask) if request.router_stats else None

            def run():
                if keep_id and self.activations.enabled:
                    return self._forward_keeping(keep_id, span, blocks, hidden, mask, positions, adapter, routers)
                with torch.inference_mode():
                    return self._compute(span, blocks, hidden, mask, positions, adapter, routers)

            tokens = hidden.shape[0] * hidden.shape[1]
            with self.served.admission.admit(tokens, hidden.nbytes):
                out = await self.served.run(run, tokens)
            packer = Packer()
            response = pb.ForwardResponse(hidden_states=packer.tensor(out, request.output_compression))
            if routers is not None:
                response.router.CopyFrom(routers.to_message())
            return packer.pack(response)

        return await _unary(context, work)

    async def backward(self, received: Received, context):
        request: pb.BackwardRequest = received.message

        async def work():
            blocks, adapter = self.served.blocks(request.span), self.served.adapter(request.span)
            hidden, mask, positions = self.served.inputs(request, received.payload)
            if not request.HasField("grad_outputs"):
                raise BadRequestError("grad_outputs is missing")
            grad = decode_tensor(request.grad_outputs, "grad_outputs", received.payload)
            validation.check_grad(grad, hidden)
            router_grad = self._router_grad(request.router_grad)

            span, training = self.served.span, None
            if request.run_id:
                training = self.training
                if training is None:
                    raise BadRequestError(
                        f"this peer does not train (run {request.run_id!r}); route training "
                        f"steps to peers started with --train --run-id {request.run_id}"
                    )
                training.check(request.run_id, blocks, request.epoch, request.micro_batch)

            def run():
                kept = self.activations.pop(request.backward_id) if request.backward_id else None
                if (
                    kept is None
                    or not kept.matches(blocks, hidden, mask, positions, adapter)
                    or (router_grad is not None and kept.routers is None)
                ):
                    # recompute the forward: the kept one expired, was evicted, or was kept by another peer
                    routers = self._routers(mask) if router_grad is not None else None
                    kept = self._forward_graph(span, blocks, hidden, mask, positions, adapter, routers)
                outputs, grads = [kept.outputs], [grad.to(span.device)]
                if router_grad is not None and kept.routers.probs is not None:  # the load-balancing loss's part
                    outputs.append(kept.routers.probs)
                    grads.append(router_grad.to(kept.routers.probs.device))
                if training is not None:
                    return training.backward(outputs, kept.inputs, grads, request.micro_batch, request.epoch)
                with torch.enable_grad():
                    (grad_inputs,) = torch.autograd.grad(outputs, kept.inputs, grads)
                return grad_inputs

            tokens = hidden.shape[0] * hidden.shape[1]
            with self.served.admission.admit(tokens, hidden.nbytes + grad.nbytes):
                grad_inputs = await self.served.run(run, tokens * 3)
            packer = Packer()
            return packer.pack(pb.BackwardResponse(grad_inputs=packer.tensor(grad_inputs, request.output_compression)))

        return await _unary(context, work)

    def _routers(self, mask: torch.Tensor | None) -> RouterStats | None:
        """Where a forward adds its routed layers' sums (None for a dense model, which has none to report)."""
        if self.moe is None:
            return None
        return RouterStats(*self.moe, row_weights=None if mask is None else mask.reshape(-1))

    def _router_grad(self, values) -> torch.Tensor | None:
        if not values:
            return None
        if self.moe is None:
            raise BadRequestError("router_grad was sent, but this model has no routers; send none")
        return check_prob_grad(values, self.moe[0])

    def _compute(self, span: BlockSpan, blocks, hidden, mask, positions, adapter: str, routers) -> torch.Tensor:
        """`blocks` of the span, yielding to decode steps between layers (peer/compute.py)."""
        between = self.served.compute.checkpoint
        return span(hidden, mask, positions, blocks=blocks, between_layers=between, adapter=adapter, routers=routers)

    def _forward_graph(
        self, span: BlockSpan, blocks, hidden, mask, positions, adapter: str = "", routers: RouterStats | None = None
    ) -> Kept:
        inputs = hidden.to(span.device).requires_grad_(True)
        with torch.enable_grad():
            outputs = self._compute(span, blocks, inputs, mask, positions, adapter, routers)
        return Kept(blocks, inputs, outputs, mask, positions, nbytes=0, adapter=adapter, routers=routers)

    def _forward_keeping(
        self, keep_id: str, span: BlockSpan, blocks, hidden, mask, positions, adapter: str, routers=None
    ) -> torch.Tensor:
        """Forward with autograd, keeping the graph for the backward with `keep_id` if it fits."""
        with ActivationStore.counting(span) as saved:  # only what is kept needs its size
            kept = self._forward_graph(span, blocks, hidden, mask, positions, adapter, routers)
        kept.nbytes = saved.bytes
        self.activations.put(keep_id, kept)
        return kept.outputs.detach()

    async def info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        async def work():
            response = self._info()
            if request.nonce:  # a client checks that who answers at this address holds the announced key
                if self._prove is None:
                    raise WrongSpanError("this peer is starting; try again shortly")
                if len(request.nonce) > MAX_NONCE_BYTES:
                    raise BadRequestError(f"a nonce has at most {MAX_NONCE_BYTES} bytes, got {len(request.nonce)}")
                if not self.proofs.take(source_of(context)):
                    raise OverloadedError(
                        "this peer signs at most 20 identity proofs per second per address; ask again in a second"
                    )
                response.identity_proof = await asyncio.to_thread(self._prove, request.nonce)
            training = self.training
            if training is not None:
                response.run_id, response.epoch, response.samples = training.run_id, training.epoch, training.samples
                response.train_mode = training.recipe.train_mode
                response.updating = training.status.state == pb.RoundStatus.AVERAGING
                response.round.CopyFrom(training.status)
                response.applied_samples = training.applied_samples
                response.applied_round.CopyFrom(training.applied_round)
                if request.held:
                    response.held.extend(training.held())
                if request.param_digest:
                    response.param_digest = await self.served.run(training.digest, tokens=1 << 20)
            return response

        return await _unary(context, work)

    # --- a training run's updates (peer/training/span.py) ---

    def _training_of(self, run_id: str) -> SpanTraining:
        if self.training is None:
            raise BadRequestError(
                f"this peer does not train (run {run_id!r}); send training calls to peers started with --train "
                f"--run-id {run_id}"
            )
        return self.training

    async def commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:
        async def work():
            status = await self._training_of(request.run_id).commit(request)
            return pb.CommitResponse(status=status)

        return await _unary(context, work)

    async def apply(self, request: pb.ApplyRequest, context) -> pb.ApplyResponse:
        async def work():
            training = self._training_of(request.run_id)
            return await training.apply(request, lambda fn: self.served.run(fn, tokens=1 << 20))

        return await _unary(context, work)

    async def state(self, request: pb.StateRequest, context) -> None:
        """Stream the span's current weights (or a LoRA run's adapters), each tensor cut along its first dimension
        into pieces (peer/state_stream.py: one caller at a time, a piece at a time)."""
        try:
            blocks = self.served.blocks(request.span)
            span = self.served.span
            if blocks != (span.start, span.end):
                raise BadRequestError(
                    f"ask for this peer's whole span {span.start}:{span.end}, not {blocks[0]}:{blocks[1]}"
                )
            if span.streamer is not None:
                raise BadRequestError(
                    "this peer streams its blocks in from a store (--offload): export from peers that hold their "
                    "blocks resident"
                )
            if span.quantization != "none":
                raise BadRequestError(
                    f"this peer holds {span.quantization}-quantized weights, not the checkpoint's: export from peers "
                    f"started without --quantize"
                )
            from peer import lora  # peft loads only when weights are asked for

            training = self.training
            weights_of = training.weights if training is not None else (lambda: lora.layer_state(span))
            if request.adapters:
                if training is None:
                    raise BadRequestError(
                        "this peer trains no run, so it has no LoRA adapters: export without --adapter-only"
                    )
                training.require_adapters()
                weights_of = training.adapters
            epoch_of = (lambda: training.epoch) if training is not None else (lambda: 0)
            await self.state_streams.stream(weights_of, context.write, epoch_of)
        except TimeoutError:  # the caller stopped reading: nothing to tell it
            return
        except SwarmError as exc:
            await _abort(context, exc)


async def _unary(context: grpc.aio.ServicerContext, work):
    """`work()`'s response, or the call aborted with the typed error it failed with."""
    try:
        return await work()
    except Exception as exc:
        error = as_swarm_error(exc, "request failed")
    await _abort(context, error)


async def _abort(context: grpc.aio.ServicerContext, error: SwarmError) -> None:
    await context.abort(status_for(error), str(error), trailing_metadata=((ERROR_CODE_KEY, error.code),))
