"""Which blocks a peer should serve: pure functions over a SwarmSnapshot (no I/O).

The swarm is only as fast as its least-served block, so a joining peer takes the window where
the swarm is weakest, and a serving peer moves only when that raises the weakest block by a margin.
Modelled on petals' server/block_selection.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from protocol.records import ServerInfo
from swarm.dht.snapshot import SwarmSnapshot


def block_throughputs(snapshot: SwarmSnapshot, *, exclude: str | None = None) -> list[float]:
    """Per block, the summed throughput of live (JOINING/ONLINE) servers covering it.

    JOINING servers count: they are loading those blocks already, so placing another peer there
    because they are not ONLINE yet would pile newcomers onto the same span. They count only for
    MAX_JOINING_S after they began (SwarmSnapshot.live), so a record stuck in JOINING cannot hold blocks.

    Args:
        exclude: a peer id left out, so a peer can see the swarm as it would be without itself.
    """
    totals = [0.0] * snapshot.num_blocks
    for peer_id, info in snapshot.live().items():
        if peer_id == exclude:
            continue
        # A record may announce blocks past the model's end; they carry no load we can use.
        for block in range(info.start_block, min(info.end_block, snapshot.num_blocks)):
            totals[block] += info.throughput
    return totals


def swarm_bottleneck(throughputs: Sequence[float]) -> float:
    """The swarm's throughput: that of its least-served block (0.0 for a model with no blocks)."""
    return min(throughputs, default=0.0)


def choose_span(snapshot: SwarmSnapshot, num_blocks_to_serve: int) -> tuple[int, int]:
    """The span `[start, end)` a new peer should serve: the window where the swarm is weakest.

    Windows are compared by their per-block throughputs sorted ascending, lexicographically, so the
    window with the most uncovered (zero) blocks wins, then the one whose weakest block is weakest,
    and so on; ties go to the lowest start. The length is clamped to the model's block count.

    Raises:
        ValueError: num_blocks_to_serve < 1.
    """
    if num_blocks_to_serve < 1:
        raise ValueError(f"num_blocks_to_serve must be at least 1, got {num_blocks_to_serve}")
    return _weakest_window(block_throughputs(snapshot), min(num_blocks_to_serve, snapshot.num_blocks))


def should_move(snapshot: SwarmSnapshot, peer_id: str, *, balance_margin: float = 0.15) -> tuple[int, int] | None:
    """The span `peer_id` should move to for rebalancing, or None to stay where it is.

    The peer's own contribution is removed, the weakest window of its current length is found, and
    the move is proposed only if it leaves no block uncovered that was covered before, and it
    either covers blocks nobody served or raises the swarm bottleneck by more than `balance_margin`
    (relative). The margin is hysteresis:
    a move costs a reload and drops the peer's sessions, and peers decide from slightly stale,
    mutually inconsistent snapshots, so moving on any gain would let them chase each other around
    the model forever. A peer absent from the snapshot, or OFFLINE, is told to stay.

    Raises:
        ValueError: balance_margin < 0.
    """
    if not balance_margin >= 0:
        raise ValueError(f"balance_margin must be >= 0, got {balance_margin}")
    info = snapshot.live().get(peer_id)
    if info is None:
        return None
    start, end = info.start_block, min(info.end_block, snapshot.num_blocks)
    if start >= end:
        return None  # it serves nothing of this model; nothing to move

    current = block_throughputs(snapshot)
    without_peer = block_throughputs(snapshot, exclude=peer_id)
    new_start, new_end = _weakest_window(without_peer, end - start)
    if (new_start, new_end) == (start, end):
        return None

    # Coverage is checked apart from throughput: a zero-throughput server still serves its blocks.
    covered_before = _covered_blocks(snapshot.live().values(), snapshot.num_blocks)
    others = [other for pid, other in snapshot.live().items() if pid != peer_id]
    covered_after = _covered_blocks(others, snapshot.num_blocks) | set(range(new_start, new_end))
    if not covered_before <= covered_after:
        return None
    if len(covered_after) > len(covered_before):
        return new_start, new_end  # serves blocks nobody served, even if others stay uncovered
    moved = list(without_peer)
    for block in range(new_start, new_end):
        moved[block] += info.throughput
    if not swarm_bottleneck(moved) > swarm_bottleneck(current) * (1.0 + balance_margin):
        return None
    return new_start, new_end


def _weakest_window(throughputs: Sequence[float], length: int) -> tuple[int, int]:
    # min() keeps the first of equal keys, which is the lowest start.
    start = min(range(len(throughputs) - length + 1), key=lambda s: sorted(throughputs[s : s + length]))
    return start, start + length


def _covered_blocks(servers: Iterable[ServerInfo], num_blocks: int) -> set[int]:
    covered: set[int] = set()
    for info in servers:
        covered.update(range(info.start_block, min(info.end_block, num_blocks)))
    return covered
