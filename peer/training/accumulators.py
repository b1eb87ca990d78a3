"""Gradients a stage peer holds for its next update: one sum per trainer, each micro-batch added once.

A trainer may send a micro-batch's backward twice (its first answer was lost, or it could not tell whether the
peer took it): the id (trainer, index) makes the second one a no-op here. A sum per trainer, not one for all, lets a
commit that leaves a trainer out (it died, or its step moved to the next update) drop exactly that trainer's share.
Sums are float32 whatever the compute dtype: bfloat16 loses a 1e-4 update on a weight of 1.0.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from protocol.errors import BadRequestError

MAX_INDEX = 1 << 20  # a step of more micro-batches than this is a malformed id


@dataclass
class _Sum:
    grads: list[torch.Tensor]
    indices: set[int] = field(default_factory=set)
    samples: int = 0


class HeldMismatch(ValueError):
    """What a commit says this peer holds is not what it holds."""


class Accumulators:
    """Per trainer: the sum of gradient x samples over its micro-batches, their indices and samples.

    Thread-safe: backward calls add from the compute thread while Info reads what is held.
    """

    def __init__(self, like: Sequence[torch.Tensor]):
        self._shapes = [(t.shape, t.device) for t in like]
        self._sums: dict[str, _Sum] = {}
        self._lock = threading.Lock()

    def holds(self, trainer: str, index: int) -> bool:
        with self._lock:
            held = self._sums.get(trainer)
            return held is not None and index in held.indices

    def add(self, trainer: str, index: int, samples: int, grads: Sequence[torch.Tensor]) -> bool:
        """Add the gradients of micro-batch (trainer, index), a mean over `samples`; False if it was added already.

        Raises:
            BadRequestError: a malformed id.
        """
        if not trainer or not 0 <= index < MAX_INDEX or samples < 1:
            raise BadRequestError(f"a micro-batch needs a trainer, an index in [0, {MAX_INDEX}) and samples >= 1")
        with self._lock:
            held = self._sums.get(trainer)
            if held is None:
                zeros = [torch.zeros(shape, dtype=torch.float32, device=device) for shape, device in self._shapes]
                held = self._sums[trainer] = _Sum(zeros)
            if index in held.indices:
                return False
            for acc, grad in zip(held.grads, grads):
                acc.add_(grad.to(torch.float32), alpha=samples)
            held.indices.add(index)
            held.samples += samples
            return True

    def held(self) -> dict[str, tuple[list[int], int]]:
        """Trainer -> (its indices held, sorted; their samples)."""
        with self._lock:
            return {t: (sorted(s.indices), s.samples) for t, s in self._sums.items()}

    def total(self, listed: Mapping[str, Sequence[int]]) -> tuple[list[torch.Tensor], int]:
        """The sum (float64) of the listed trainers' gradient sums, and their samples.

        Raises:
            HeldMismatch: for a listed trainer, the indices held here are not exactly the listed ones.
        """
        with self._lock:
            out = [torch.zeros(shape, dtype=torch.float64, device=device) for shape, device in self._shapes]
            samples = 0
            for trainer in sorted(listed):  # a fixed order: every member sums the same way
                want = set(listed[trainer])
                held = self._sums.get(trainer)
                have = held.indices if held is not None else set()
                if want != have:
                    raise HeldMismatch(
                        f"trainer {trainer[-8:]}'s micro-batches: the commit lists {sorted(want)}, this peer holds "
                        f"{sorted(have)}"
                    )
                if held is None:
                    continue
                for acc, grad in zip(out, held.grads):
                    acc.add_(grad.to(torch.float64))
                samples += held.samples
            return out, samples

    def drop(self, trainers: Sequence[str]) -> int:
        """Forget what `trainers` sent; the samples forgotten."""
        with self._lock:
            return sum(self._sums.pop(t).samples for t in trainers if t in self._sums)

    def clear(self) -> None:
        with self._lock:
            self._sums.clear()
