"""Blocks beyond memory: a peer whose memory budget does not hold its span keeps the first blocks resident and
streams the others in, each loaded while the block before it computes.

- The budget (`swarmlm peer --memory-budget`) counts the bytes of block weights and KV cache resident at once.
  When every block fits beside a small cache, nothing streams. Otherwise two blocks' worth goes to the streaming
  slots (the block computing and the next one loading), the KV cache gets up to `--cache-tokens` of what is left,
  and the rest holds blocks from the span's start (`plan_memory`).
- Streamed blocks wait in pinned host memory (`--offload host`: for a GPU) or in one file each
  (`--offload disk`, written once at load in the block's dtype, after quantization; DiskStore). They are loaded on a
  prefetch thread; only the compute thread puts weights into a block or takes them out.
- A streamed block's module keeps meta tensors while it is out. Its weights go in and out as new tensor objects,
  never changed in place, so a graph that autograd saved for a backward keeps the weights it used (a forward with
  a backward after it holds them until then: the budget bounds inference and forward passes).

A fixed resident prefix beats LRU here: passes go through the span in order, and LRU would evict every block just
before its next use, loading all of them each pass; the prefix loads only the streamed ones.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn
from transformers import PretrainedConfig

from protocol.vocab import Offload
from swarm.models.checkpoint import tensor_shapes

logger = logging.getLogger(__name__)

MIN_CACHE_TOKENS = 256  # a budget must leave the KV cache at least this much
STREAM_SLOTS = 2  # the block computing and the next one loading
# bytes: what torch's CPU allocator gives every tensor. CPU kernels choose their code path by alignment: a block's
# weights at another alignment compute its output differently in the last bits (and take the slower paths).
ALIGNMENT = 64
_FOLDER_PREFIX = "swarmlm-offload-"  # then the pid of the peer whose blocks it holds
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes of a size such as "3MB", "512MiB", "8GB" or "1.5GB" (decimal units, and binary with "i")."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if found is None or found.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a size: give a number with a unit, such as 512MB, 8GB or 1.5GiB")
    size = int(float(found.group(1)) * _UNITS[found.group(2)])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return size


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def block_bytes(path: Path, config: PretrainedConfig, start: int, end: int, dtype: torch.dtype) -> list[int]:
    """Bytes of each block [start, end) in `dtype`, from the checkpoint's headers (nothing is loaded)."""
    size = torch.empty((), dtype=dtype).element_size()
    found = []
    for i in range(start, end):
        prefix = f"model.layers.{i}."
        shapes = tensor_shapes(path, lambda name, prefix=prefix: name.startswith(prefix))
        found.append(sum(math.prod(shape) for shape in shapes.values()) * size)
    return found


def kv_token_bytes(config: PretrainedConfig, start: int, end: int, dtype: torch.dtype) -> int:
    """KV-cache bytes of one token over blocks [start, end): a key and a value per KV head in every block."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * heads * head_dim * torch.empty((), dtype=dtype).element_size() * (end - start)


@dataclass(frozen=True)
class MemoryPlan:
    """How a span is held within a memory budget."""

    budget_bytes: int
    resident: int
    """Blocks held all the time, from the span's start."""
    streamed: int
    """Blocks loaded when they compute, through STREAM_SLOTS slots."""
    cache_tokens: int
    """KV-cache tokens the budget leaves."""
    resident_bytes: int
    """Most bytes of block weights resident at once: the resident blocks and the streaming slots."""

    def describe(self) -> str:
        held = f"{self.resident} blocks resident"
        if self.streamed:
            held += f", {self.streamed} streamed through {STREAM_SLOTS} slots"
        return (
            f"a budget of {format_size(self.budget_bytes)}: {held} (at most {format_size(self.resident_bytes)}), "
            f"a KV cache of {self.cache_tokens} tokens"
        )


def plan_memory(
    blocks: Sequence[int], token_bytes: int, cache_tokens: int, budget_bytes: int, offload: Offload
) -> MemoryPlan:
    """Split `budget_bytes` between blocks of `blocks` bytes each and a KV cache of `token_bytes` a token.

    Raises:
        ValueError: the budget is too small, saying the least it must be (or, without offload, what to change).
    """
    total, least_cache = sum(blocks), MIN_CACHE_TOKENS * token_bytes
    if total + least_cache <= budget_bytes:
        tokens = min(cache_tokens, (budget_bytes - total) // token_bytes)
        return MemoryPlan(budget_bytes, len(blocks), 0, tokens, total)
    if offload == Offload.NONE or len(blocks) <= STREAM_SLOTS:
        raise ValueError(
            f"{len(blocks)} blocks need {format_size(total)} beside a KV cache of at least {MIN_CACHE_TOKENS} tokens "
            f"({format_size(least_cache)}), more than the budget of {format_size(budget_bytes)}: serve fewer blocks, "
            f"raise --memory-budget"
            + ("" if len(blocks) <= STREAM_SLOTS else ", or stream the rest from disk or host memory with --offload")
        )
    slots = STREAM_SLOTS * max(blocks)
    left = budget_bytes - slots
    if left < least_cache:
        raise ValueError(
            f"a budget of {format_size(budget_bytes)} holds less than {STREAM_SLOTS} blocks ({format_size(slots)}) "
            f"and a KV cache of {MIN_CACHE_TOKENS} tokens: give --memory-budget at least "
            f"{format_size(slots + least_cache)}"
        )
    tokens = min(cache_tokens, left // token_bytes)
    left -= tokens * token_bytes
    resident = 0
    while resident < len(blocks) - STREAM_SLOTS and blocks[resident] <= left:
        left -= blocks[resident]
        resident += 1
    return MemoryPlan(budget_bytes, resident, len(blocks) - resident, tokens, sum(blocks[:resident]) + slots)


class HostStore:
    """Streamed blocks' weights in host memory, pinned for a GPU, copied to it on a stream of their own."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._blocks: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, index: int, state: dict[str, torch.Tensor]) -> None:
        # the block was built on the device: its copy waits in host memory, pinned so that it copies back at full speed
        self._blocks[index] = {
            name: t.detach().to("cpu").pin_memory() if self._cuda else t.detach().clone() for name, t in state.items()
        }

    def get(self, index: int) -> dict[str, torch.Tensor]:
        if not self._cuda:
            return {name: t.clone() for name, t in self._blocks[index].items()}
        with torch.cuda.stream(self._stream):
            state = {name: t.to(self.device, non_blocking=True) for name, t in self._blocks[index].items()}
        self._stream.synchronize()
        return state

    def close(self) -> None:
        self._blocks.clear()


class DiskStore:
    """Streamed blocks' (or experts') weights in a folder of files, one per block, removed at close (and, after a peer
    was killed, by the next peer that stores blocks in the same parent folder).

    A file holds its tensors' bytes back to back, each at an ALIGNMENT boundary; their names, dtypes, shapes and
    offsets stay in memory. `get` reads a file with one read into memory of its own and views the tensors from it:
    the weights are read on the thread that asks (a prefetch thread), each at the alignment the CPU kernels expect,
    and nothing maps the file. (safetensors' load_file maps it: its pages were then read wherever the weights were
    first used, on the compute thread, and each tensor, at the file's offsets, had to be copied to be aligned.)"""

    def __init__(self, device: torch.device, parent: Path | None = None):
        self.device = device
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
            _remove_orphans(parent)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-", dir=parent))
        self._layouts: dict[int, tuple[list[_Stored], int]] = {}

    def put(self, index: int, state: dict[str, torch.Tensor]) -> None:
        layout, offset = [], 0
        with open(self._file(index), "wb") as file:
            for name, tensor in state.items():
                tensor = tensor.detach().to("cpu").contiguous()
                offset = -(-offset // ALIGNMENT) * ALIGNMENT
                size = tensor.numel() * tensor.element_size()
                file.seek(offset)
                file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
                layout.append(_Stored(name, tensor.dtype, tuple(tensor.shape), offset, size))
                offset += size
        self._layouts[index] = (layout, offset)

    def nbytes(self, index: int) -> int:
        """The bytes `get` reads for block `index`."""
        return self._layouts[index][1]

    def get(self, index: int, into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Block `index`'s tensors, read into `into` (uint8, at least nbytes(index); None: memory of their own), then
        copied to a GPU device."""
        layout, size = self._layouts[index]
        data = torch.empty(size, dtype=torch.uint8) if into is None else into[:size]
        view, done = memoryview(data.numpy()), 0
        with open(self._file(index), "rb", buffering=0) as file:
            while done < size:  # one read, unless the kernel cuts a large one
                read = file.readinto(view[done:])
                if not read:
                    raise OSError(f"{self._file(index)} ends at {done} of its {size} bytes: was it changed?")
                done += read
        state = {s.name: data[s.offset : s.offset + s.size].view(s.dtype).view(s.shape) for s in layout}
        if self.device.type != "cpu":
            state = {name: t.to(self.device) for name, t in state.items()}
        return state

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def _file(self, index: int) -> Path:
        return self.folder / f"block-{index}.weights"


@dataclass(frozen=True)
class _Stored:
    """Where one tensor of a DiskStore file is."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    size: int


Store = HostStore | DiskStore


def take_out(store: Store, index: int, module: nn.Module) -> None:
    """At load: hand block `index`'s weights to `store` and leave its module with meta tensors."""
    state = module.state_dict()
    store.put(index, state)
    _assign(module, {name: torch.empty_like(t, device="meta") for name, t in state.items()})


class Streamer:
    """The modules of a span's blocks: resident ones as they are, streamed ones loaded one ahead of their use."""

    def __init__(self, layers: Sequence[nn.Module], first: int, resident: int, store: Store):
        self.layers, self.first, self.resident, self.store = list(layers), first, resident, store
        self._pending: dict[int, Future] = {}  # streamed block -> its weights, loaded or loading
        self._inside: set[int] = set()  # streamed blocks whose module holds its weights now
        # On a CPU, blocks from disk are read into the slots' buffers, reused from block to block: a fresh buffer a
        # load cost its allocation, and freed on another thread than it was taken on, it left the allocator holding
        # more memory than the budget. A buffer is reused only if every pass that used its block ran without grad:
        # a graph kept for a backward holds the weights, which must then not change.
        self._reuse = isinstance(store, DiskStore) and store.device.type == "cpu"
        self._free: list[torch.Tensor] = []  # buffers no block uses
        self._buffers: dict[int, torch.Tensor] = {}  # streamed block -> the buffer it was read into
        self._graded: set[int] = set()  # streamed blocks used with grad since they were loaded
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="swarmlm-prefetch")
        self._lock = threading.Lock()  # counters are read by other threads (status, tests)
        self.loads = 0
        self.buffers_made = 0  # read buffers allocated (on a CPU, from disk): STREAM_SLOTS when each is reused
        self.waited_s = 0.0  # time the compute thread waited for a block that was not loaded yet
        self.streamed_bytes = 0
        self.peak_streamed_bytes = 0

    def layer(self, index: int) -> nn.Module:
        """Block `index`'s module, holding its weights (call on the compute thread, right before running it)."""
        offset = index - self.first
        if offset < self.resident:
            return self.layers[offset]
        for other in [i for i in self._pending if i != index]:  # the block computed before is done with
            self._drop(other)
        if index not in self._pending:
            self._pending[index] = self._pool.submit(self._load, index)
        if torch.is_grad_enabled():
            self._graded.add(index)
        if index not in self._inside:
            began = time.perf_counter()
            state = self._pending[index].result()
            with self._lock:
                self.waited_s += time.perf_counter() - began
            for tensor in state.values():
                if tensor.is_cuda:  # made on the prefetch stream, used on this one: not to be reused before
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
            _assign(self.layers[offset], state)
            self._inside.add(index)
        following = self._next(index)
        if following not in self._pending:
            self._pending[following] = self._pool.submit(self._load, following)
        return self.layers[offset]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._free.clear()
        self._buffers.clear()
        self.store.close()

    def _next(self, index: int) -> int:
        """The streamed block after `index`, from the last one back to the first streamed one (the next pass)."""
        after = index + 1
        return after if after - self.first < len(self.layers) else self.first + self.resident

    def _load(self, index: int) -> dict[str, torch.Tensor]:
        if not self._reuse:
            state = self.store.get(index)
        else:
            size = self.store.nbytes(index)
            with self._lock:
                fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
                if fits:
                    buffer = self._free.pop(fits[0])
                else:  # as large as the largest streamed block, so that any block fits in any buffer
                    streamed = range(self.first + self.resident, self.first + len(self.layers))
                    buffer = torch.empty(max(self.store.nbytes(i) for i in streamed), dtype=torch.uint8)
                    self.buffers_made += 1
                self._buffers[index] = buffer
            state = self.store.get(index, into=buffer)
        size = sum(t.numel() * t.element_size() for t in state.values())
        with self._lock:
            self.loads += 1
            self.streamed_bytes += size
            self.peak_streamed_bytes = max(self.peak_streamed_bytes, self.streamed_bytes)
        return state

    def _drop(self, index: int) -> None:
        future = self._pending.pop(index)
        try:
            state = future.result()  # a load under way finishes first; its tensors are then let go
        except Exception:  # it is loaded again, and fails again, where it is needed
            with self._lock:
                self._buffers.pop(index, None)
            return
        if index in self._inside:
            module = self.layers[index - self.first]
            _assign(module, {name: torch.empty_like(t, device="meta") for name, t in state.items()})
            self._inside.discard(index)
        graded = index in self._graded
        self._graded.discard(index)
        with self._lock:
            self.streamed_bytes -= sum(t.numel() * t.element_size() for t in state.values())
            buffer = self._buffers.pop(index, None)
            if buffer is not None and not graded and len(self._free) < STREAM_SLOTS:
                self._free.append(buffer)


def _assign(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put `state`'s tensors into `module` as new parameters and buffers (the old tensors are not changed)."""
    for name, tensor in state.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if isinstance(getattr(owner, leaf), nn.Parameter):
            setattr(owner, leaf, nn.Parameter(tensor, requires_grad=False))
        else:
            setattr(owner, leaf, tensor)


def _remove_orphans(parent: Path) -> None:
    """Remove the block folders of peers that are gone (killed before they could remove their own)."""
    for folder in parent.glob(f"{_FOLDER_PREFIX}*"):
        pid = folder.name.removeprefix(_FOLDER_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
