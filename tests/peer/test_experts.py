"""Experts offloaded with an LRU cache and prefetch (peer/experts.py): exact against resident experts, and counted."""

from __future__ import annotations

import pytest
import torch

from peer.blocks import load_span
from peer.experts import install_expert_cache
from swarm.models.checkpoint import load_config
from tests.helpers.models import MOE_CONFIGS, save_random_model

SPANS = {"mixtral": (1, 4), "qwen2_moe": (0, 3), "qwen3_moe": (0, 4)}  # qwen2_moe's block 1 is dense


@pytest.fixture(scope="module", params=sorted(SPANS))
def moe(request, tmp_path_factory):
    family = request.param
    path = save_random_model(MOE_CONFIGS[family](4), tmp_path_factory.mktemp(family), seed=3)
    return family, path


NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")


def _span(path, blocks, device="cpu"):
    return load_span(path, load_config(path), *blocks, dtype=torch.float32, device=torch.device(device))


def _cached_span(path, blocks, caches):
    """The span of `blocks` on the CPU, its experts cached by `caches` as each block is built."""
    return load_span(path, load_config(path), *blocks, dtype=torch.float32, device=torch.device("cpu"), experts=caches)


def _assert_same_outputs(resident, cached, hidden: torch.Tensor) -> None:
    """A prefill of `hidden` (moved to the spans' device), then decode steps through a cache, one token at a time
    (the experts come and go): the cached span's outputs are the resident one's."""
    hidden = hidden.to(resident.device)
    with torch.no_grad():
        torch.testing.assert_close(cached(hidden), resident(hidden), atol=1e-5, rtol=1e-5)
        cache_a, cache_b = resident.new_cache(), cached.new_cache()
        resident(hidden[:, :4], cache=cache_a), cached(hidden[:, :4], cache=cache_b)
        for t in range(4, 9):
            step_a = resident(hidden[:, t : t + 1], cache=cache_a, prefix_length=t)
            step_b = cached(hidden[:, t : t + 1], cache=cache_b, prefix_length=t)
            torch.testing.assert_close(step_b, step_a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "capacity, prefetch, device",
    [(1, False, "cpu"), (1, True, "cpu"), (2, True, "cpu"), pytest.param(2, True, "cuda", marks=NO_GPU)],
)
def test_cached_experts_compute_what_resident_ones_do(moe, capacity, prefetch, device):
    """On a GPU, guesses are copied on a stream of their own: the compute must wait for them where they are used."""
    family, path = moe
    blocks = SPANS[family]
    resident, cached = _span(path, blocks, device), _span(path, blocks, device)
    caches = install_expert_cache(cached, capacity, prefetch=prefetch)
    num_experts = next(iter(caches.layers.values()))[1].num_experts
    _assert_same_outputs(resident, cached, torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(0)))
    stats = caches.stats
    assert stats.misses > 0 and stats.hits + stats.misses > 0
    assert all(len(c.resident) <= capacity for _, c in caches.layers.values())
    assert (stats.prefetched > 0) == prefetch
    assert capacity < num_experts


def test_the_span_must_have_experts_and_the_cache_one_slot(tmp_path):
    from tests.helpers.models import llama_config

    dense = save_random_model(llama_config(2), tmp_path / "llama", seed=1)
    with pytest.raises(ValueError, match="no experts to cache"):
        install_expert_cache(_span(dense, (0, 2)), 2)
    moe = save_random_model(MOE_CONFIGS["mixtral"](2), tmp_path / "mixtral", seed=1)
    with pytest.raises(ValueError, match="at least 1 expert"):
        install_expert_cache(_span(moe, (0, 2)), 0)


def test_a_guess_fills_up_to_the_whole_cache_and_keeps_what_it_names(moe):
    """Prefetch brings in the guess's experts, most likely first, up to the cache's size; a guessed expert already
    resident becomes the most recently used, so the guess's own loads do not evict it."""
    family, path = moe
    span = _span(path, SPANS[family])
    caches = install_expert_cache(span, 2, prefetch=True)
    _, cached = next(iter(caches.layers.values()))
    cached.prefetch([3, 0, 2])  # of 4 experts
    assert list(cached.resident) == [3, 0] and caches.stats.prefetched == 2
    cached.prefetch([3, 1])  # 3 kept: 0, the least recently used now, makes room for 1
    assert list(cached.resident) == [3, 1] and caches.stats.prefetched == 3
    assert caches.stats.loads == 3


def test_experts_on_disk_compute_the_same_and_hold_no_host_copies(moe, tmp_path):
    """`--expert-store disk`: each block's experts go to files as the block is built (load_span's `experts`), host
    memory keeps none of them, the outputs are the resident span's, and closing the span removes the files."""
    from peer.experts import ExpertCaches
    from peer.offload import DiskStore

    family, path = moe
    blocks = SPANS[family]
    resident = _span(path, blocks)
    caches = ExpertCaches(2, torch.device("cpu"), prefetch=True, store=DiskStore(torch.device("cpu"), tmp_path))
    cached = _cached_span(path, blocks, caches)
    assert cached.expert_caches is caches and caches.layers
    assert all(c.host is None and not c.resident for _, c in caches.layers.values())
    files = list(caches.store.folder.glob("block-*.weights"))
    assert len(files) == sum(c.num_experts for _, c in caches.layers.values())
    _assert_same_outputs(resident, cached, torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)))
    assert caches.stats.misses > 0 and caches.stats.prefetched > 0
    cached.close()
    assert not caches.store.folder.exists()


def test_a_dense_span_given_a_disk_cache_is_refused_and_leaves_no_files(tmp_path):
    from peer.experts import ExpertCaches
    from peer.offload import DiskStore
    from tests.helpers.models import llama_config

    dense = save_random_model(llama_config(2), tmp_path / "llama", seed=1)
    caches = ExpertCaches(1, torch.device("cpu"), prefetch=False, store=DiskStore(torch.device("cpu"), tmp_path / "x"))
    with pytest.raises(ValueError, match="no experts to cache"):
        load_span(dense, load_config(dense), 0, 2, dtype=torch.float32, device=torch.device("cpu"), experts=caches)
    assert not caches.store.folder.exists()


def test_guesses_from_disk_are_read_on_the_reader_thread_and_a_guess_evicted_unread_costs_nothing(moe, tmp_path):
    """With the experts on disk, a guess is read on the cache's reader thread while the compute goes on; the compute
    reads only its misses itself. A guess evicted before it was used, its read under way or not, is dropped."""
    import threading

    from peer.experts import ExpertCaches
    from peer.offload import DiskStore

    readers: list[str] = []

    class WatchedStore(DiskStore):  # the real store, telling which thread reads
        def get(self, index):
            readers.append(threading.current_thread().name)
            return super().get(index)

    family, path = moe
    blocks = SPANS[family]
    resident = _span(path, blocks)
    caches = ExpertCaches(1, torch.device("cpu"), prefetch=True, store=WatchedStore(torch.device("cpu"), tmp_path))
    cached = _cached_span(path, blocks, caches)
    _, layer = next(iter(caches.layers.values()))
    layer.prefetch([0])
    layer.prefetch([1])  # 0's read is dropped, under way or not
    assert list(layer.resident) == [1] and set(layer._reads) <= {1}

    _assert_same_outputs(resident, cached, torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(2)))
    stats = caches.stats
    assert stats.prefetched > 0 and stats.misses > 0 and stats.waited_s >= 0.0
    compute = threading.current_thread().name
    assert readers.count(compute) == stats.misses, "the compute thread read more than its misses"
    assert sum(name.startswith("swarmlm-experts") for name in readers) >= stats.prefetch_used > 0
    cached.close()
    assert not caches.store.folder.exists()


def test_a_guess_whose_read_failed_is_read_again_when_picked(moe, tmp_path):
    """A read that fails on the reader thread fails the forward that needs it, and leaves the expert not resident:
    the next forward reads it again (it would otherwise find no weights under a resident expert)."""
    from peer.experts import ExpertCaches
    from peer.offload import DiskStore

    class FlakyStore(DiskStore):
        failures = 1

        def get(self, index):
            if FlakyStore.failures:
                FlakyStore.failures -= 1
                raise OSError("the disk hiccupped")
            return super().get(index)

    family, path = moe
    blocks = SPANS[family]
    resident = _span(path, blocks)
    caches = ExpertCaches(8, torch.device("cpu"), prefetch=True, store=FlakyStore(torch.device("cpu"), tmp_path))
    cached = _cached_span(path, blocks, caches)
    _, layer = next(iter(caches.layers.values()))
    layer.prefetch(list(range(layer.num_experts)))  # every expert guessed: the first read fails
    hidden = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), pytest.raises(OSError, match="hiccupped"):
        cached(hidden)
    with torch.no_grad():
        torch.testing.assert_close(cached(hidden), resident(hidden), atol=1e-5, rtol=1e-5)
    cached.close()
