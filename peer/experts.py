"""Mixture-of-experts offloading (`swarmlm peer --expert-cache N`): per layer, at most N experts are resident on the
compute device; the others wait in host memory and come in when the router picks them.

transformers 5 keeps a layer's experts as two 3-d parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]) in a
module whose forward takes the router's choices (Mixtral, Qwen2-MoE, Qwen3-MoE alike). `CachedExperts` takes that
module's place: it holds each expert's two matrices apart, keeps the N most recently used on the device (LRU), and
computes the chosen experts as transformers' eager loop does, so outputs equal the resident layer's to rounding.

Speculative prefetch, as in Eliseev and Mazur's MoE offloading: before a layer runs, the next layer's router is
applied to the hidden state entering this one (normalized as that router's input is), and the experts it would
pick are brought in, as many as the cache holds. The residual stream changes little from one layer to the next,
so the guess is often right; a wrong guess costs a load and may evict an expert still needed. Measured by
bench/experts.py on a small model trained on Shakespeare, the guess is right for 41-73% of the experts it brings
(a third on random weights) and raises the hit rate from 5% to 29% at 1 expert a layer and from 59% to 72% at 2;
but every guess is a load, so it copies more onto the device than LRU alone (5.0 experts a decode step against
3.3 at 2 a layer). On a GPU a guess is copied on a stream of its own while the layer before computes, and the
compute waits for it only where the expert is used; a miss is copied when picked. That overlap has not run on a GPU
yet (none was lent), so prefetch is off by default (`--expert-prefetch`). With the experts on disk
(`--expert-store disk`), a guess is read from its file on a reader thread of its own while the layer before
computes, on a CPU too, and the compute waits for that read only where the expert is used. With the experts in host
memory on a CPU, the device is host memory, so nothing is saved: only the mechanism and its hit rate are exercised.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from peer.offload import DiskStore


@dataclass
class ExpertStats:
    """Counts over every cached layer of a peer, since start."""

    hits: int = 0  # experts the router picked that were resident
    misses: int = 0  # experts the router picked that had to be loaded then
    prefetched: int = 0  # experts loaded ahead on a guess
    prefetch_used: int = 0  # of those, the ones the router then picked while still resident
    waited_s: float = 0.0  # time the compute waited for guesses still being read from disk when they were picked

    @property
    def loads(self) -> int:
        """Experts copied onto the device: misses, and guesses (right or wrong)."""
        return self.misses + self.prefetched

    @property
    def hit_rate(self) -> float:
        used = self.hits + self.misses
        return self.hits / used if used else 0.0

    def describe(self) -> str:
        return (
            f"expert cache: {self.hits} hits, {self.misses} misses (hit rate {self.hit_rate:.1%}), "
            f"{self.prefetched} prefetched, {self.prefetch_used} of them used"
        )


class CachedExperts(nn.Module):
    """A layer's experts with at most `capacity` of them on `device` (the rest in host memory)."""

    def __init__(
        self,
        experts: nn.Module,
        capacity: int,
        device: torch.device,
        stats: ExpertStats,
        store: DiskStore | None = None,
        first_key: int = 0,
        reader: ThreadPoolExecutor | None = None,
    ):
        """`store`: where the experts wait on disk, under keys `first_key` + expert (None: in host memory);
        `reader`: the thread that reads guesses from `store` (None: they are read where they are guessed)."""
        super().__init__()
        self.num_experts, self.act_fn = experts.num_experts, experts.act_fn
        self.capacity, self.device, self.stats = capacity, device, stats
        self.store, self._first_key, self._reader = store, first_key, reader
        self.host: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        pin = device.type == "cuda"
        with torch.no_grad():
            pairs = [(experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()) for e in range(self.num_experts)]
            if store is None:
                self.host = [
                    tuple((t.to("cpu").clone().pin_memory() if pin else t.to("cpu").clone()) for t in pair)
                    for pair in pairs
                ]
            else:
                for e, (gate_up, down) in enumerate(pairs):  # each file holds its view's bytes alone
                    store.put(first_key + e, {"gate_up": gate_up, "down": down})
        # an expert whose guess is still being read on the reader thread is resident with weights None, its read in
        # _reads: the cache's order and size count it from the guess on
        self.resident: collections.OrderedDict[int, tuple[torch.Tensor, torch.Tensor] | None] = (
            collections.OrderedDict()
        )
        self._reads: dict[int, Future] = {}
        self.guessed: set[int] = set()  # prefetched and not yet used
        self._lock = threading.Lock()  # forwards run on the compute thread, and on the event loop for tiny steps
        # on a GPU a guess is copied on a stream of its own, beside the layer computing meanwhile; the compute
        # stream waits for that copy only when the expert is used
        self._copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._arriving: dict[int, torch.cuda.Event] = {}

    def _load(self, expert: int, ahead: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The expert's weights on the device, loaded if need be (a guess from disk: None while its read is under
        way on the reader thread, see _ready)."""
        if expert in self.resident:
            self.resident.move_to_end(expert)
            return self.resident[expert]
        while len(self.resident) >= self.capacity:
            evicted, _ = self.resident.popitem(last=False)
            self.guessed.discard(evicted)
            self._arriving.pop(evicted, None)
            read = self._reads.pop(evicted, None)
            if read is not None:
                read.cancel()  # not started yet: never read; under way: its weights are dropped
        if ahead and self._reader is not None and self.store is not None:
            self.resident[expert] = None
            self._reads[expert] = self._reader.submit(self._copy, expert, self._copies)
            return None
        weights, event = self._copy(expert, self._copies if ahead else None)
        if event is not None:
            self._arriving[expert] = event
        self.resident[expert] = weights
        return weights

    def _copy(self, expert: int, stream) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.cuda.Event | None]:
        """The expert's weights copied onto the device on `stream` (None: the current stream), and the event its copy
        records there (None without a stream). Runs on the reader thread for a guess read from disk."""
        with torch.cuda.stream(stream):  # None: the current stream (and on a CPU, nothing to choose)
            weights = tuple(t.to(self.device, non_blocking=True) for t in self._waiting(expert))
        if stream is None:
            return weights, None
        event = torch.cuda.Event()
        event.record(stream)
        return weights, event

    def _ready(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A resident expert's weights, once a read of it still under way on the reader thread is done."""
        read = self._reads.pop(expert, None)
        if read is None:
            return self.resident[expert]
        began = time.perf_counter()
        try:
            weights, event = read.result()
        except BaseException:
            del self.resident[expert]  # not resident after all: loaded again when next picked
            raise
        self.stats.waited_s += time.perf_counter() - began
        if event is not None:
            self._arriving[expert] = event
        self.resident[expert] = weights
        return weights

    def _waiting(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert's weights where they wait: host memory, or read from its file (a copy in memory of its own)."""
        if self.host is not None:
            return self.host[expert]
        state = self.store.get(self._first_key + expert)
        return state["gate_up"], state["down"]

    def _arrived(self, expert: int, weights: tuple[torch.Tensor, ...]) -> None:
        """Before a guessed expert's first use on a GPU: the compute stream waits for its copy, and its memory is
        not reused before the compute stream is done with it."""
        event = self._arriving.pop(expert, None)
        if event is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for tensor in weights:
            tensor.record_stream(compute)

    def prefetch(self, experts: list[int]) -> None:
        """Bring in `experts` (a guess of what the router will pick, most likely first), as many as the cache holds.
        A guessed expert already resident becomes the most recently used, so the guess's own loads keep it.
        (Bringing in at most half the cache, what LRU keeps being worth more than a guess, was the policy until a
        trained model was measured: there a full cache of guesses won at 1 and 2 experts a layer, bench/experts.py.)"""
        with self._lock:
            for expert in experts[: self.capacity]:
                if expert in self.resident:
                    self.resident.move_to_end(expert)
                    continue
                self._load(expert, ahead=True)
                self.guessed.add(expert)
                self.stats.prefetched += 1

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            chosen = [int(e) for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0] if e < self.num_experts]
        with self._lock:
            for expert in chosen:
                if expert in self.resident:
                    self.stats.hits += 1
                    if expert in self.guessed:
                        self.stats.prefetch_used += 1
                else:
                    self.stats.misses += 1
                self.guessed.discard(expert)
                # as transformers' eager loop computes it, expert by expert in index order
                self._load(expert)
                gate_up, down = weights = self._ready(expert)
                self._arrived(expert, weights)
                top_k_pos, token_idx = torch.where(mask[expert])
                gate, up = F.linear(hidden_states[token_idx], gate_up).chunk(2, dim=-1)
                out = F.linear(self.act_fn(gate) * up, down) * top_k_weights[token_idx, top_k_pos, None]
                final.index_add_(0, token_idx, out.to(final.dtype))
        return final


class ExpertCaches:
    """The cached experts of a span's layers, and the prefetch of the next layer's guess."""

    def __init__(self, capacity: int, device: torch.device, *, prefetch: bool, store: DiskStore | None = None):
        """`store`: the experts not on the device wait on disk there (None: in host memory)."""
        if capacity < 1:
            raise ValueError(f"an expert cache holds at least 1 expert a layer, got {capacity}")
        self.capacity, self.device, self.store = capacity, device, store
        self.stats, self.prefetching = ExpertStats(), prefetch
        self.layers: dict[int, tuple[nn.Module, CachedExperts]] = {}
        self._keys = 0
        # guesses are read from disk on a thread of their own, beside the compute (one for the span: a disk serves
        # one read at a time well, and the layers' guesses come one layer after another)
        self._reader = (
            ThreadPoolExecutor(1, thread_name_prefix="swarmlm-experts") if store is not None and prefetch else None
        )

    def add(self, index: int, layer: nn.Module) -> None:
        """Cache the experts of block `index` (a dense block is left as it is); peer/blocks.py calls it as each
        block is built, so that with a store on disk, loading holds one block's experts at most."""
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or getattr(experts, "gate_up_proj", None) is None:
            return  # a dense layer (Qwen2-MoE's mlp_only_layers)
        cached = CachedExperts(experts, self.capacity, self.device, self.stats, self.store, self._keys, self._reader)
        self._keys += cached.num_experts
        mlp.experts = cached
        self.layers[index] = (layer, cached)

    def close(self) -> None:
        """Stop the reader (a read under way ends first) and remove the experts' files (a cache in host memory has
        nothing to do)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:
            self.store.close()

    def before(self, index: int, hidden: torch.Tensor) -> None:
        """Layer `index` is about to run on `hidden`: guess and bring in the experts of the next one."""
        found = self.layers.get(index + 1) if self.prefetching else None
        if found is None:
            return
        layer, cached = found
        with torch.no_grad():
            flat = layer.post_attention_layernorm(hidden).reshape(-1, hidden.shape[-1])
            _, _, picked = layer.mlp.gate(flat)
            counts = torch.bincount(picked.reshape(-1), minlength=cached.num_experts)
        cached.prefetch([int(e) for e in torch.argsort(counts, descending=True) if counts[e] > 0])


def install_expert_cache(span, capacity: int, *, prefetch: bool = True, store: DiskStore | None = None) -> ExpertCaches:
    """Replace the experts of `span`'s MoE layers by CachedExperts of `capacity` (span.expert_caches is set); with
    `store`, the experts off the device wait on disk.

    Raises:
        ValueError: the span has no experts, or capacity < 1.
    """
    caches = ExpertCaches(capacity, span.device, prefetch=prefetch, store=store)
    for j, layer in enumerate(span.layers):
        caches.add(span.start + j, layer)
    return attach(span, caches)


def attach(span, caches: ExpertCaches) -> ExpertCaches:
    """Make `caches`, filled as the span's blocks were built, the span's (span.expert_caches).

    Raises:
        ValueError: the span has no experts (the store's files are removed).
    """
    if not caches.layers:
        caches.close()
        raise ValueError(f"blocks {span.start}:{span.end} have no experts to cache: drop --expert-cache")
    span.expert_caches = caches
    return caches
