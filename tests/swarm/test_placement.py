"""Block placement and rebalancing, on hand-built snapshots."""

from __future__ import annotations

import pytest

from protocol.records import CLOCK_SKEW_S, MAX_JOINING_S, ServerInfo, ServerState
from swarm.dht.snapshot import SwarmSnapshot
from swarm.placement import block_throughputs, choose_span, should_move, swarm_bottleneck


def server(start: int, end: int, throughput: float, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(
        state=state,
        start_block=start,
        end_block=end,
        throughput=throughput,
        cache_tokens_left=4096,
        dtype="float32",
        version="1",
        endpoint="127.0.0.1:5000",
    )


def swarm(num_blocks: int, **servers: ServerInfo) -> SwarmSnapshot:
    return SwarmSnapshot(num_blocks=num_blocks, servers=dict(servers))


# block_throughputs / swarm_bottleneck


def test_block_throughputs_sums_live_servers_and_skips_offline() -> None:
    snap = swarm(
        6,
        a=server(0, 4, 10.0),
        b=server(2, 6, 5.0, ServerState.JOINING),
        c=server(0, 6, 100.0, ServerState.OFFLINE),
    )
    assert block_throughputs(snap) == [10.0, 10.0, 15.0, 15.0, 5.0, 5.0]


def test_block_throughputs_excludes_one_peer() -> None:
    snap = swarm(4, a=server(0, 4, 10.0), b=server(1, 3, 5.0))
    assert block_throughputs(snap, exclude="a") == [0.0, 5.0, 5.0, 0.0]
    assert block_throughputs(snap, exclude="nobody") == [10.0, 15.0, 15.0, 10.0]


def test_block_throughputs_ignores_blocks_past_the_model_end() -> None:
    assert block_throughputs(swarm(3, a=server(1, 9, 2.0))) == [0.0, 2.0, 2.0]


def test_swarm_bottleneck_is_the_weakest_block() -> None:
    assert swarm_bottleneck([5.0, 1.5, 7.0]) == 1.5
    assert swarm_bottleneck([]) == 0.0


# choose_span


def test_empty_swarm_starts_at_block_zero() -> None:
    assert choose_span(swarm(10), 3) == (0, 3)


def test_uncovered_blocks_are_picked_first() -> None:
    # Blocks 6..9 are uncovered; both (6, 9) and (7, 10) are all zeros, so the lowest start wins.
    snap = swarm(10, a=server(0, 6, 1.0))
    assert choose_span(snap, 3) == (6, 9)


def test_uncovered_gap_in_the_middle_is_picked() -> None:
    snap = swarm(12, a=server(0, 5, 50.0), b=server(8, 12, 50.0))
    assert choose_span(snap, 3) == (5, 8)


def test_even_a_slow_server_beats_no_server() -> None:
    # Window (0, 2) has one uncovered block; (2, 4) is covered, if slowly.
    snap = swarm(4, a=server(1, 2, 100.0), b=server(2, 4, 0.5))
    assert choose_span(snap, 2) == (0, 2)


def test_weakest_window_is_chosen() -> None:
    snap = swarm(8, a=server(0, 8, 10.0), b=server(0, 3, 20.0), c=server(6, 8, 20.0))
    # Per block: [30, 30, 30, 10, 10, 10, 30, 30]
    assert choose_span(snap, 3) == (3, 6)
    assert choose_span(snap, 2) == (3, 5)


def test_windows_compare_by_sorted_throughputs_not_by_sum() -> None:
    # Per block [2, 2, 500, 1]: (0, 2) has the lowest sum, but (2, 4) holds the weakest block.
    snap = swarm(4, a=server(0, 2, 2.0), b=server(2, 3, 500.0), c=server(3, 4, 1.0))
    assert choose_span(snap, 2) == (2, 4)


def test_offline_servers_do_not_count_as_coverage() -> None:
    snap = swarm(6, a=server(0, 3, 10.0), b=server(3, 6, 10.0, ServerState.OFFLINE))
    assert choose_span(snap, 3) == (3, 6)


def test_joining_servers_count_as_coverage() -> None:
    snap = swarm(6, a=server(0, 3, 10.0), b=server(3, 6, 10.0, ServerState.JOINING), c=server(0, 3, 1.0))
    assert choose_span(snap, 3) == (3, 6)  # 10 < 11: still weaker, but covered
    snap = swarm(6, a=server(0, 3, 10.0), b=server(3, 6, 20.0, ServerState.JOINING))
    assert choose_span(snap, 3) == (0, 3)


def test_length_is_clamped_to_the_model() -> None:
    assert choose_span(swarm(10, a=server(0, 5, 1.0)), 50) == (0, 10)
    assert choose_span(swarm(10), 10) == (0, 10)


@pytest.mark.parametrize("bad", [0, -3])
def test_nonpositive_length_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match="num_blocks_to_serve"):
        choose_span(swarm(10), bad)


# should_move


def test_moves_when_the_gain_is_large() -> None:
    snap = swarm(8, a=server(0, 4, 100.0), b=server(0, 4, 100.0), c=server(4, 8, 10.0))
    # Bottleneck 10 -> 100 if b moves to the weak half.
    assert should_move(snap, "b") == (4, 8)


def test_stays_when_the_gain_is_under_the_margin() -> None:
    snap = swarm(8, a=server(0, 4, 105.0), b=server(0, 4, 10.0), c=server(4, 8, 100.0))
    # Moving b to (4, 8) raises the bottleneck 100 -> 105: +5%, under the default 15%.
    assert should_move(snap, "b") is None
    assert should_move(snap, "b", balance_margin=0.04) == (4, 8)
    assert should_move(snap, "b", balance_margin=0.05) is None  # the gain must exceed the margin


def test_no_move_back_after_moving() -> None:
    snap = swarm(8, a=server(0, 4, 100.0), b=server(0, 4, 100.0), c=server(4, 8, 10.0))
    assert should_move(snap, "b") == (4, 8)
    moved = swarm(8, a=server(0, 4, 100.0), b=server(4, 8, 100.0), c=server(4, 8, 10.0))
    assert should_move(moved, "b") is None
    assert should_move(moved, "a") is None
    assert should_move(moved, "c") is None


def test_stays_when_already_in_the_best_place() -> None:
    snap = swarm(8, a=server(0, 4, 100.0), b=server(4, 8, 100.0))
    assert should_move(snap, "a") is None
    assert should_move(snap, "b") is None


def test_never_uncovers_a_block_it_alone_serves() -> None:
    # b alone serves block 0; blocks 4..7 are weak, yet leaving would uncover block 0.
    snap = swarm(8, a=server(1, 4, 100.0), b=server(0, 4, 100.0), c=server(4, 8, 1.0))
    assert should_move(snap, "b", balance_margin=0.0) is None


def test_moves_to_cover_the_only_uncovered_blocks() -> None:
    snap = swarm(6, a=server(0, 3, 10.0), b=server(0, 3, 10.0))
    assert should_move(snap, "b") == (3, 6)


def test_moves_to_cover_some_blocks_even_if_others_stay_uncovered() -> None:
    # After b moves into the gap, block 5 stays uncovered (the bottleneck stays 0), but 3 and 4 gain a server.
    snap = swarm(6, a=server(0, 3, 10.0), b=server(0, 2, 10.0))
    assert should_move(snap, "b") == (3, 5)


def test_unknown_or_offline_peer_stays() -> None:
    snap = swarm(8, a=server(0, 4, 100.0), b=server(0, 4, 100.0, ServerState.OFFLINE))
    assert should_move(snap, "nobody") is None
    assert should_move(snap, "b") is None


def test_joining_peer_may_move() -> None:
    snap = swarm(8, a=server(0, 4, 100.0), b=server(0, 4, 100.0, ServerState.JOINING), c=server(4, 8, 10.0))
    assert should_move(snap, "b") == (4, 8)


def test_negative_margin_is_rejected() -> None:
    with pytest.raises(ValueError, match="balance_margin"):
        should_move(swarm(4, a=server(0, 4, 1.0)), "a", balance_margin=-0.1)


# JOINING counts for MAX_JOINING_S after it began


NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    "joined_ago_s, counts",
    [
        (0.0, True),
        (MAX_JOINING_S - 1, True),
        (MAX_JOINING_S + 1, False),  # stuck (or lying) in JOINING: its blocks are free for newcomers
        (-CLOCK_SKEW_S - 1, False),  # in the future: joined_at cannot be pushed ahead to last longer
        (NOW, False),  # joined_at 0: a record that does not say when it began
    ],
)
def test_a_joining_record_counts_as_coverage_only_for_a_bounded_time(joined_ago_s, counts):
    joining = server(0, 4, 100.0, ServerState.JOINING).model_copy(update={"joined_at": NOW - joined_ago_s})
    snap = SwarmSnapshot(num_blocks=8, servers={"j": joining, "o": server(4, 8, 10.0)}, taken_at=NOW)
    assert ("j" in snap.live()) is counts
    assert block_throughputs(snap) == ([100.0] * 4 if counts else [0.0] * 4) + [10.0] * 4
    assert choose_span(snap, 4) == ((4, 8) if counts else (0, 4))
    assert (snap.uncovered_blocks(online_only=False) == []) is counts


def test_an_online_record_is_not_bounded_by_joined_at():
    snap = SwarmSnapshot(num_blocks=4, servers={"o": server(0, 4, 10.0)}, taken_at=NOW)
    assert list(snap.live()) == ["o"]
