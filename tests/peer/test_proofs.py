"""Identity proofs are metered per client address and in all (peer/proofs.py)."""

from __future__ import annotations

from peer.proofs import ProofMeter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_from_one_address_is_refused_and_others_are_served():
    clock = Clock()
    meter = ProofMeter(per_source_s=2.0, burst=4, all_s=1000.0, clock=clock)
    assert [meter.take("ipv4:10.0.0.1") for _ in range(6)] == [True] * 4 + [False] * 2
    assert meter.take("ipv4:10.0.0.2") and meter.refused == 2
    clock.now += 1.0  # two more a second
    assert [meter.take("ipv4:10.0.0.1") for _ in range(3)] == [True, True, False]


def test_many_addresses_share_one_bound_in_all():
    clock = Clock()
    meter = ProofMeter(per_source_s=10.0, burst=10, all_s=5.0, clock=clock)
    assert sum(meter.take(f"ipv4:10.0.0.{i}") for i in range(20)) == 5
    clock.now += 1.0
    assert sum(meter.take(f"ipv4:10.1.0.{i}") for i in range(20)) == 5
