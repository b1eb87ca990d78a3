"""The README's figure of bench/scaling.py: tokens/s against trainers, a round every update and local steps side by
side, one panel per vocabulary, from the figures each run keeps beside its table (bench/figures/scaling-*.json)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

FIGURES = Path(__file__).resolve().parent / "figures"
PLOT = FIGURES / "scaling.png"
SERIES = {
    "a round every update": "",
    "local steps (8) and int8 syncs": ", local steps",
    "the same, syncs overlapped": ", local steps, overlapped",
}
"""Line label -> the suffix of bench/scaling.py's run names ("2 trainers" + suffix); 1 trainer is in both."""


def series(figures: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Line label -> (trainer counts, tokens/s) from one run's figures; a count without its run is left out, and a
    line without any (a run kept before it existed)."""
    lines = {}
    for label, suffix in SERIES.items():
        counts, rates = [1], [figures["1 trainer"]["tokens_per_s"]]
        for count in (2, 4):
            found = figures.get(f"{count} trainers{suffix}")
            if found is not None:
                counts.append(count)
                rates.append(found["tokens_per_s"])
        if len(counts) > 1:
            lines[label] = (counts, rates)
    return lines


def draw(folder: Path = FIGURES, out: Path = PLOT) -> Path | None:
    """Draw every kept run of `folder` into `out`; None when there is none (or no matplotlib: the tables stand)."""
    kept = sorted(folder.glob("scaling-*.json"))
    if not kept:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(5.0 * len(kept), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    for i, path in enumerate(kept):
        run = json.loads(path.read_text())
        ax = fig.add_subplot(1, len(kept), i + 1)
        one = run["figures"]["1 trainer"]["tokens_per_s"]
        ax.plot([1, 4], [one, 4 * one], color="lightgray", linestyle="--", label="N x one trainer")
        for label, (counts, rates) in series(run["figures"]).items():
            ax.plot(counts, rates, marker="o", label=label)
        ax.set_title(f"{textwrap.fill(run['title'], 60)}\nrun of {run['when'].replace('T', ' ')}", fontsize=9)
        ax.set_xlabel("trainers")
        ax.set_xticks([1, 2, 4])
        ax.set_ylabel("tokens/s, all trainers")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("More trainers over a slow network (python -m bench.scaling)", fontsize=11)
    fig.savefig(out, dpi=100)
    return out
