"""Summaries of timed samples, and `Row`: one measured figure beside its reference and its target."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between the two nearest samples."""
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Summary:
    """Median and spread of repeated measurements (p10/p90; min/max for very few samples)."""

    median: float
    p10: float
    p90: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> Summary:
        if not samples:
            raise ValueError("no samples to summarize")
        return cls(
            statistics.median(samples),
            percentile(samples, 10),
            percentile(samples, 90),
            min(samples),
            max(samples),
            len(samples),
        )

    def scaled(self, factor: float) -> Summary:
        return Summary(
            self.median * factor, self.p10 * factor, self.p90 * factor, self.min * factor, self.max * factor, self.n
        )


@dataclass(frozen=True)
class Target:
    """A goal for a row's ratio, value or excess over its reference: `ratio <= 1.15`, `value < 10`, ..."""

    on: str  # "ratio", "value", or "excess" (value - reference)
    op: str  # "<=", "<", ">=", ">"
    bound: float
    text: str

    def met(self, ratio: float | None, value: float, reference: float | None = None) -> bool | None:
        if self.on == "excess":
            x = None if reference is None else value - reference
        else:
            x = ratio if self.on == "ratio" else value
        if x is None or not math.isfinite(x):
            return None
        return {"<=": x <= self.bound, "<": x < self.bound, ">=": x >= self.bound, ">": x > self.bound}[self.op]


@dataclass
class Row:
    """One figure of one scenario: ours (median and spread) vs the reference, the ratio, and the target."""

    scenario: str
    config: str
    variant: str
    metric: str
    unit: str
    ours: Summary
    reference: Summary | None = None
    reference_name: str = ""
    target: Target | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.reference is None or not self.reference.median:
            return None
        return self.ours.median / self.reference.median

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.target.met(self.ratio, self.ours.median, self.reference.median if self.reference else None)

    def to_json(self) -> dict:
        data = asdict(self)
        data["target"] = self.target.text if self.target else None
        data["ratio"] = self.ratio
        data["met"] = self.met
        return data


def time_call(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds one call of `fn` takes, `sync` (e.g. CUDA) included on both sides."""
    sync()
    began = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - began
