"""The State call (`swarmlm export` reads a span's weights with it): one caller at a time, piece by piece.

Copying the whole span for each caller let 30 callers that never read hold 30 copies. Now:
- one stream runs at a time; at most MAX_WAITING callers wait for it (each at most WAIT_S), others get
  OverloadedError at once;
- each piece (at most `piece_bytes`) is copied on the compute thread just before it is sent, so a stream holds
  one piece beyond the weights it reads (a LoRA run's merged weights are computed once per stream);
- a piece that its caller does not take within the write timeout ends the stream (TimeoutError);
- a training update applied while the stream runs ends it with TrainingFaultError: pieces of two updates never
  mix.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

import torch

from protocol import swarmlm_pb2 as pb
from protocol.errors import OverloadedError, TrainingFaultError
from protocol.packing import Packer
from swarm.runtime import within

PIECE_BYTES = 16 * 1024 * 1024  # weights travel in pieces of at most this size (messages stop at 64 MiB)
MAX_WAITING = 4
WAIT_S = 60.0

Run = Callable[[Callable[[], object]], Awaitable[object]]
"""Runs a function on the compute thread (ServedSpan.run)."""


class StateStreams:
    """The peer's State streams: `stream` sends the weights to one caller, through `write`."""

    def __init__(self, run: Run, write_timeout_s: float, piece_bytes: int = PIECE_BYTES):
        self.run, self.write_timeout_s, self.piece_bytes = run, write_timeout_s, piece_bytes
        self._gate = asyncio.Lock()
        self.waiting = 0
        self.refused = 0  # callers turned away with OverloadedError

    async def stream(
        self,
        weights_of: Callable[[], dict[str, torch.Tensor]],
        write: Callable[[pb.StatePart], Awaitable[None]],
        epoch_of: Callable[[], int] = lambda: 0,
    ) -> None:
        """Send the weights `weights_of()` returns (on the compute thread), piece by piece, through `write`.

        Raises:
            OverloadedError: MAX_WAITING callers wait already, or this one waited WAIT_S.
            TimeoutError: the caller did not take a piece within the write timeout.
            TrainingFaultError: an update was applied to the weights while they were sent.
        """
        if self._gate.locked() and self.waiting >= MAX_WAITING:
            self.refused += 1
            raise OverloadedError(
                f"this peer sends its weights to one caller at a time and {self.waiting} are waiting; retry later"
            )
        self.waiting += 1
        try:
            await within(self._gate.acquire(), WAIT_S)
        except TimeoutError:
            self.refused += 1
            raise OverloadedError(
                f"waited {WAIT_S:.0f}s for another caller's weights to be sent; retry later"
            ) from None
        finally:
            self.waiting -= 1
        try:
            epoch = epoch_of()
            weights = await self.run(weights_of)
            for name, tensor in weights.items():
                for rows, last in _row_ranges(tensor, self.piece_bytes):

                    def copy(tensor=tensor, rows=rows) -> torch.Tensor:
                        if epoch_of() != epoch:
                            raise TrainingFaultError(
                                f"an update was applied while this peer sent its weights (update {epoch} to "
                                f"{epoch_of()}); ask again"
                            )
                        piece = tensor if rows is None else tensor[rows[0] : rows[1]]
                        return piece.detach().cpu().clone()

                    piece = await self.run(copy)
                    packer = Packer()
                    part = packer.pack(pb.StatePart(name=name, tensor=packer.tensor(piece), last=last))
                    del piece
                    await within(write(part), self.write_timeout_s)
        finally:
            self._gate.release()


def _row_ranges(tensor: torch.Tensor, max_bytes: int) -> Iterator[tuple[tuple[int, int] | None, bool]]:
    """(rows, is_last) along the first dimension, each under `max_bytes` unless one row is larger; rows None:
    the whole tensor in one piece."""
    if tensor.dim() == 0 or tensor.numel() * tensor.element_size() <= max_bytes:
        yield None, True
        return
    row_bytes = max(1, tensor[0].numel() * tensor.element_size())
    rows = max(1, max_bytes // row_bytes)
    for start in range(0, tensor.shape[0], rows):
        yield (start, min(start + rows, tensor.shape[0])), start + rows >= tensor.shape[0]
