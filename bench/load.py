"""How busy the machine was with work that is not ours while a scenario ran (other users' jobs, say).

Timings on a shared machine are only as good as its quiet; each scenario reports the average number of
cores that processes outside the benchmark's own process tree kept busy, so a reader can tell.
"""

from __future__ import annotations

import time

import psutil


def _busy_s() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def _ours_s() -> float:
    """CPU seconds of this process, its reaped children, and its live descendants."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


class OutsideLoad:
    """`with OutsideLoad() as load: ...` then `load.cores`: average cores used by others meanwhile."""

    def __enter__(self) -> OutsideLoad:
        self._wall, self._busy, self._ours = time.monotonic(), _busy_s(), _ours_s()
        self.cores: float | None = None
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._wall
        if wall > 0:
            others = (_busy_s() - self._busy) - (_ours_s() - self._ours)
            self.cores = max(0.0, others / wall)
