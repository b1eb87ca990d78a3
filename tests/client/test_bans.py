"""The client's ban list: a failing peer is banned, longer each time, up to a cap, and comes back afterwards."""

from __future__ import annotations

from client.bans import BanList


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bans_double_with_each_failure_up_to_a_minute_and_then_lift():
    clock = Clock()
    bans = BanList(base_s=2.0, clock=clock)
    assert bans.banned() == set()
    lengths = []
    for _ in range(7):
        lengths.append(bans.ban("a"))
        assert bans.banned() == {"a"}
        clock.now += lengths[-1] - 0.01
        assert bans.banned() == {"a"}, "lifted before its time"
        clock.now += 0.02
        assert bans.banned() == set(), "never lifted"
    assert lengths == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


def test_peers_are_banned_independently():
    clock = Clock()
    bans = BanList(base_s=1.0, clock=clock)
    bans.ban("a")
    bans.ban("a")  # two strikes: 2 s
    bans.ban("b")  # one strike: 1 s
    clock.now += 1.5
    assert bans.banned() == {"a"}
    clock.now += 1.0
    assert bans.banned() == set()
    assert bans.ban("b") == 2.0  # strikes are remembered after the ban lifts


def test_a_peer_silent_since_it_failed_stays_banned_until_it_announces_again():
    """A crashed peer's record outlives it; the ban must not lift while no record newer than the failure exists."""
    clock = Clock()
    bans = BanList(base_s=1.0, clock=clock)
    before = {"crashed": 500.0, "alive": 500.0}
    bans.observe(before, read_at=clock.now - 1)  # a read from before the failures tells nothing about them
    bans.ban("crashed")
    bans.ban("alive")
    clock.now += 1.5  # the ban itself is over, but nothing was read since the failures
    assert bans.banned(before) == {"crashed", "alive"}
    # the first read after the failures: both re-announced just before failing (e.g. a crash right after)
    after = {"crashed": 504.0, "alive": 504.0}
    bans.observe(after, read_at=clock.now)
    assert bans.banned(after) == {"crashed", "alive"}
    assert bans.banned({"crashed": 504.0, "alive": 509.0}) == {"crashed"}  # "alive" announced again
    assert bans.banned({"crashed": 530.0, "alive": 509.0}) == set()  # restarted with its identity, announced


def test_a_new_announcement_does_not_shorten_the_ban():
    clock = Clock()
    bans = BanList(base_s=4.0, clock=clock)
    bans.ban("a")
    bans.observe({"a": 500.0}, read_at=clock.now)
    clock.now += 1.0
    assert bans.banned({"a": 505.0}) == {"a"}
    clock.now += 3.5
    assert bans.banned({"a": 505.0}) == set()


def test_strikes_halve_with_each_quiet_period():
    """One slip long after a run of failures costs a short ban, not the capped one."""
    clock = Clock()
    bans = BanList(base_s=1.0, clock=clock, half_life_s=100.0)
    for _ in range(6):
        bans.ban("a")
    assert bans.strikes("a") == 6
    clock.now += 99.0
    assert bans.strikes("a") == 6, "decayed before a whole quiet period"
    clock.now += 1.0
    assert bans.strikes("a") == 3
    assert bans.ban("a") == 8.0  # 3 + 1 strikes: 2 ** 3 s, not the 60 s seven strikes would cost
    clock.now += 250.0  # two whole quiet periods since that failure: 4 -> 1
    assert bans.strikes("a") == 1
    clock.now += 1000.0
    assert bans.strikes("a") == 0
    assert bans.ban("a") == 1.0  # forgotten: a first failure again


def test_failures_within_a_quiet_period_keep_growing():
    clock = Clock()
    bans = BanList(base_s=1.0, clock=clock, half_life_s=100.0)
    lengths = []
    for _ in range(4):
        lengths.append(bans.ban("a"))
        clock.now += 60.0  # each failure comes before the previous one's quiet period is over
    assert lengths == [1.0, 2.0, 4.0, 8.0]
    assert bans.strikes("b") == 0
