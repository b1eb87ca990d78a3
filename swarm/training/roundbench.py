"""How long a round among a known group takes, against a bare hivemind averager averaging the same tensors.

`python -m swarm.training.roundbench [--members 3] [--mib 16] [--repeats 3]` prints a JSON line; `bench` can call
`compare_with_hivemind`. Issue 22's target: a round takes at most 1.2x a bare all-reduce. Both sides run here, on
127.0.0.1, with the same group and tensors: the bare averagers (on DHT nodes of their own) form their group by hivemind's matchmaking first (with
target_group_size = the members, so a full group starts at once), and are timed from the moment every member holds
its group (require_trigger) to the end of the all-reduce; the step as a whole, matchmaking included, is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage

from swarm.dht.node import start_dht, start_plain_dht, stop_dht, visible_maddrs
from swarm.training.rounds import RoundAverager, RoundSettings


def _in_threads(calls) -> tuple[list, float]:
    """Run each call in a thread of its own, all released at once: (results, seconds until the last one ended)."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls) + 1)

    def run(index: int) -> None:
        barrier.wait()
        results[index] = calls[index]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - began


def _bare_step(averagers: list[DecentralizedAverager], timeout_s: float) -> tuple[float, float]:
    """(seconds of the all-reduce once every member holds its group, seconds of the whole step), the slowest member's."""
    began = time.perf_counter()
    controls = [a.step(timeout=timeout_s, require_trigger=True, wait=False) for a in averagers]
    while any(c.stage != AveragingStage.AWAITING_TRIGGER for c in controls):
        if any(c.done() for c in controls):
            raise RuntimeError(f"matchmaking failed: {[c.exception() for c in controls if c.done()]}")
        time.sleep(0.001)
    grouped = time.perf_counter()
    for control in controls:
        control.allow_allreduce()
    for control in controls:
        control.result(timeout=timeout_s)
    ended = time.perf_counter()
    return ended - grouped, ended - began


def compare_with_hivemind(
    *, members: int = 3, numel: int = 1 << 21, repeats: int = 3, timeout_s: float = 120.0
) -> dict[str, float]:
    """Average `members` float64 tensors of `numel` values `repeats` times each way; medians in seconds.

    Returns:
        round_s (from all members entering a round to the last one's result), bare_allreduce_s, bare_step_s, and
        round_over_bare (the ratio of the first two).
    """
    dhts, averagers = [], []
    try:
        for _ in range(members):
            dhts.append(start_dht(visible_maddrs(dhts[0]) if dhts else ()))
        plain = []
        for _ in range(members):
            plain.append(start_plain_dht(visible_maddrs(plain[0]) if plain else ()))
            dhts.append(plain[-1])
        tensors = [[torch.randn(numel, dtype=torch.float64)] for _ in range(members)]
        rounds = [
            RoundAverager(t, dht, prefix="bench_rounds", settings=RoundSettings())
            for t, dht in zip(tensors, dhts[:members])
        ]
        averagers += rounds
        bare = [
            DecentralizedAverager(
                [t[0].clone()],
                dht,
                start=True,
                prefix="bench_bare",
                target_group_size=members,
                min_group_size=members,
                min_matchmaking_time=2.0,
                request_timeout=1.0,
            )
            for t, dht in zip(tensors, plain)
        ]
        averagers += bare
        ids = [a.member_id for a in rounds]
        round_s, allreduce_s, step_s = [], [], []
        for repeat in range(repeats):
            round_id = b"bench-%d" % repeat
            results, seconds = _in_threads(
                [
                    lambda a=a, t=t, r=round_id: a.average(t, round_id=r, members=ids, timeout_s=timeout_s)
                    for a, t in zip(rounds, tensors)
                ]
            )
            if not all(r.complete for r in results):
                raise RuntimeError(f"a benchmark round was incomplete: {[r.reason for r in results]}")
            round_s.append(seconds)
            allreduce, step = _bare_step(bare, timeout_s)
            allreduce_s.append(allreduce)
            step_s.append(step)
        medians = {
            "round_s": statistics.median(round_s),
            "bare_allreduce_s": statistics.median(allreduce_s),
            "bare_step_s": statistics.median(step_s),
        }
        return medians | {"round_over_bare": medians["round_s"] / medians["bare_allreduce_s"]}
    finally:
        for averager in averagers:
            if averager.is_alive():
                averager.shutdown()
        for dht in dhts:
            stop_dht(dht)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--mib", type=float, default=16.0, help="size of each member's tensor (float64)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    numel = int(args.mib * (1 << 20) / 8)
    print(json.dumps(compare_with_hivemind(members=args.members, numel=numel, repeats=args.repeats)))


if __name__ == "__main__":
    main()
