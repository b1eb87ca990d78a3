"""Summaries of timed samples, and `Row`: one measured figure beside its reference and its target.

`Row.to_json` / `Row.from_json` round-trip a row through results.json, so that a run's figures can be redrawn
from it (bench/report.py --from).
"""

from __future__ import annotations

import math
import re
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

    @staticmethod
    def from_json(rule: dict | None, text: str | None) -> Target | None:
        """The target that `Row.to_json` wrote: its rule, or for results.json written before rules were, its text."""
        if rule is not None:
            return Band(**rule) if "low" in rule else Target(**rule)
        return None if text is None else parse_target(text)


@dataclass(frozen=True)
class Band(Target):
    """A target that the ratio lies between `low` and `bound`."""

    low: float = 0.0

    def met(self, ratio: float | None, value: float, reference: float | None = None) -> bool | None:
        within = super().met(ratio, value, reference)
        return within if within is not True else ratio >= self.low


_NUMBER = r"(\d+(?:\.\d+)?)"
_OP = r"(<=|<|>=|>)"


def parse_target(text: str) -> Target:
    """A target from its text alone, in the forms the scenarios write: `<= 1.15x local`, `0.98-1.02x local`,
    `<= 2 ms over gRPC direct`, `< 10 s`. Texts are rounded, so a verdict near the bound may differ from the run's.

    Raises:
        ValueError: the text is in none of those forms.
    """
    if found := re.match(rf"{_NUMBER}-{_NUMBER}x", text):
        return Band("ratio", "<=", float(found[2]), text, low=float(found[1]))
    if found := re.match(rf"{_OP} ?{_NUMBER}x", text):
        return Target("ratio", found[1], float(found[2]), text)
    if found := re.match(rf"{_OP} ?{_NUMBER} \S+ over ", text):
        return Target("excess", found[1], float(found[2]), text)
    if found := re.match(rf"{_OP} ?{_NUMBER}", text):
        return Target("value", found[1], float(found[2]), text)
    raise ValueError(f"target {text!r} is in none of the forms a scenario writes ('<= 1.15x local', '< 10 s', ...)")


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
        data["target_rule"] = asdict(self.target) if self.target else None
        data["ratio"] = self.ratio
        data["met"] = self.met
        return data

    @classmethod
    def from_json(cls, data: dict) -> Row:
        """The row that `to_json` wrote (its ratio and verdict are computed again)."""
        reference = data.get("reference")
        return cls(
            scenario=data["scenario"],
            config=data["config"],
            variant=data["variant"],
            metric=data["metric"],
            unit=data["unit"],
            ours=Summary(**data["ours"]),
            reference=Summary(**reference) if reference is not None else None,
            reference_name=data.get("reference_name", ""),
            target=Target.from_json(data.get("target_rule"), data.get("target")),
            extra=data.get("extra") or {},
        )


def time_call(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds one call of `fn` takes, `sync` (e.g. CUDA) included on both sides."""
    sync()
    began = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - began
