"""Forward activations kept for the backward that follows, so that it need not recompute the forward.

Keeping is only an optimisation: a backward whose activations were evicted, expired, or kept by another
peer recomputes the forward from the inputs it carries. The store is bounded in bytes (oldest entries
are evicted first) and in time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarm.models.routers import RouterStats


@dataclass
class Kept:
    """The autograd graph of one forward: `outputs` as a function of `inputs` (a leaf that requires grad)."""

    blocks: tuple[int, int]
    inputs: torch.Tensor
    outputs: torch.Tensor
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    nbytes: int
    expires: float = 0.0
    adapter: str = ""  # the named adapter it computed with (peer/adapters.py)
    routers: RouterStats | None = None  # its routed layers' sums, in the graph (swarm/models/routers.py)

    def matches(self, blocks, hidden: torch.Tensor, mask, positions, adapter: str = "") -> bool:
        """Whether this graph computed exactly the forward a backward request describes."""
        return (
            self.blocks == blocks
            and self.adapter == adapter
            and _equal(self.inputs.detach(), hidden)
            and _equal(self.mask, mask)
            and _equal(self.positions, positions)
        )


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))


class SavedBytes:
    """Counts the bytes autograd saves for backward, leaving out tensors that share a parameter's memory."""

    def __init__(self, module: torch.nn.Module):
        self.bytes = 0
        self._seen = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


class ActivationStore:
    """Kept forwards by id, at most `max_bytes` of them, each for at most `ttl_s`. Thread-safe."""

    def __init__(self, max_bytes: int, ttl_s: float):
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self._entries: OrderedDict[str, Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    @contextlib.contextmanager
    def counting(module: torch.nn.Module) -> Iterator[SavedBytes]:
        """Within the block, forwards through `module` count what they save for backward."""
        saved = SavedBytes(module)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            yield saved

    def put(self, key: str, kept: Kept) -> bool:
        """Keep `kept` under `key`, evicting the oldest entries to make room; False if it can never fit."""
        if kept.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._drop_expired()
            self._remove(key)
            while self._bytes + kept.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))
            kept.expires = time.monotonic() + self.ttl_s
            self._entries[key] = kept
            self._bytes += kept.nbytes
        return True

    def pop(self, key: str) -> Kept | None:
        with self._lock:
            self._drop_expired()
            return self._remove(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _remove(self, key: str) -> Kept | None:
        kept = self._entries.pop(key, None)
        if kept is not None:
            self._bytes -= kept.nbytes
        return kept

    def _drop_expired(self) -> None:
        now = time.monotonic()
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.expires > now:
                break
            self._remove(key)
