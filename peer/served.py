"""The span a peer serves, and what every request to it goes through, unary or streamed: the check that it asks
for blocks served here, input validation and admission, the one compute thread, and the typed error that an
unexpected failure becomes. peer/handler.py (forward, backward, info, state) and peer/inference.py (the inference
stream) build on it.
"""

from __future__ import annotations

import logging

from peer import validation
from peer.admission import Admission, WorkLimits
from peer.blocks import BlockSpan
from peer.compute import TRAINING, ComputeQueue
from protocol import swarmlm_pb2 as pb
from protocol.codec import decode_optional, layout
from protocol.errors import BadRequestError, SwarmError, WrongSpanError

logger = logging.getLogger(__name__)

INLINE_COMPUTE_TOKENS = 4  # steps up to this many tokens (batch x length) compute on the event loop


class ServedSpan:
    """The blocks served now, behind the checks that every request passes before it computes on them."""

    def __init__(self, model_config, prefix: str, work: WorkLimits):
        self.prefix = prefix
        self.span: BlockSpan | None = None  # None while the peer loads or moves its blocks
        self.hidden_size = model_config.hidden_size
        self.num_blocks = model_config.num_hidden_layers
        self.max_positions = model_config.max_position_embeddings
        self.admission = Admission(work, self.max_positions)
        self.compute = ComputeQueue()
        self._busy = 0  # computations queued for or running on the compute thread

    def close(self) -> None:
        self.compute.close()

    def blocks(self, span: pb.Span) -> tuple[int, int]:
        """The blocks a request asks for, if this peer serves them all.

        Raises:
            WrongSpanError: another model, blocks served elsewhere, or none served yet.
        """
        if span.model != self.prefix:
            raise WrongSpanError(f"this peer serves model {self.prefix!r}, not {span.model!r}")
        if self.span is None:
            raise WrongSpanError("this peer is loading its blocks; use another peer or try again shortly")
        if not self.span.start <= span.start < span.end <= self.span.end:
            raise WrongSpanError(
                f"this peer serves blocks {self.span.start}:{self.span.end}, not {span.start}:{span.end}"
            )
        return span.start, span.end

    def adapter(self, span: pb.Span) -> str:
        """The named adapter a request asks for ("" for none), if this peer serves it.

        Raises:
            WrongSpanError: this peer does not serve it (another peer's record may list it).
        """
        if not span.adapter:
            return ""
        served = self.span.adapters.folders if self.span is not None and self.span.adapters is not None else {}
        if span.adapter not in served:
            raise WrongSpanError(
                f"this peer serves no adapter {span.adapter[:64]!r} (it serves {sorted(served) or 'none'}); "
                f"use a peer whose record lists it"
            )
        return span.adapter

    def inputs(self, message, payload: memoryview, prefix_length: int = 0):
        """A request's (hidden states, attention mask, position ids), checked against the span and the hard caps."""
        if not message.HasField("hidden_states"):
            raise BadRequestError("hidden_states is missing")
        # shapes, dtype and caps as declared, before decoding widens anything (float16 on the wire to the declared
        # float32 or float64, a mask to int64): a request over the caps costs no memory
        declared = layout(message.hidden_states, "hidden_states")
        validation.check_hidden_layout(
            declared.shape, declared.dtype, hidden_size=self.hidden_size, dtype=self.span.dtype
        )
        batch, seq, _ = declared.shape
        self.admission.check(batch, seq, prefix_length)
        if message.HasField("attention_mask"):
            shape = layout(message.attention_mask, "attention_mask").shape
            validation.check_mask_shape(shape, batch=batch, length=prefix_length + seq)
        if message.HasField("position_ids"):
            validation.check_positions_shape(layout(message.position_ids, "position_ids").shape, batch=batch, seq=seq)
        hidden = decode_optional(message, "hidden_states", payload)
        validation.check_hidden(hidden, hidden_size=self.hidden_size, dtype=self.span.dtype)
        mask = validation.check_mask(
            decode_optional(message, "attention_mask", payload), batch=batch, length=prefix_length + seq
        )
        positions = validation.check_positions(
            decode_optional(message, "position_ids", payload), batch=batch, seq=seq, max_positions=self.max_positions
        )
        return hidden, mask, positions

    async def run(self, fn, tokens: int, priority: int = TRAINING):
        """Run `fn` on the compute thread (peer/compute.py); a step of a few tokens runs right here instead.

        A decode step takes milliseconds, and the two thread switches around it cost a good share of
        that on a busy machine; a longer computation goes to the thread so the network is served meanwhile.
        """
        if tokens <= INLINE_COMPUTE_TOKENS and not self._busy:
            return fn()
        self._busy += 1
        try:
            return await self.compute.run(fn, priority)
        finally:
            self._busy -= 1


def as_swarm_error(exc: Exception, what: str) -> SwarmError:
    """What a request that failed with `exc` answers: our own errors as they are; anything else is a bug of ours,
    logged with its traceback under `what` and answered as an internal error, while the peer goes on serving."""
    if isinstance(exc, SwarmError):
        return exc
    logger.error("%s", what, exc_info=exc)
    return SwarmError(f"internal error on the peer: {type(exc).__name__}: {exc}")
