"""A scenario's figure, drawn from its rows alone: `scenario_figure` returns it, the caller saves it.

One panel per metric. Where the metric has a reference, the bars are ratios, ours / reference, per setting (whiskers:
ours' p10-p90 over the reference's median), with both medians written on each bar, a line at 1x, and each target drawn
as a horizontal line over the settings it holds for (a value bound becomes its ratio to that setting's reference).
A metric without a reference is drawn in its own unit. Rows whose `extra` holds loss `curves` (train_swarm) get a
panel of curves above. Bars are coloured by series, the model unless SERIES says otherwise, one legend entry each;
legends sit right of their panel, never over the bars. The run's start goes in the title, so that a figure pairs
with its table.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from bench.stats import Band, Row, Target

# Scenarios whose variant ends with the series ("3 peers, 10 ms one-way, peer to peer"): bars grouped per delay.
SERIES: dict[str, Callable[[Row], tuple[str, str]]] = {
    "wan": lambda row: tuple(reversed(row.variant.rsplit(", ", 1))) if ", " in row.variant else (row.config, ""),
    "speculative": lambda row: (
        tuple(reversed(row.variant.rsplit(", ", 1))) if ", " in row.variant else (row.config, "")
    ),
}
# Scenarios whose metrics are one bar or two each: one panel for all their ratios, a bar per metric and setting.
ONE_PANEL = {"train_swarm"}
TARGET_STYLES = ["--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]
BAR_AREA = 0.8  # of each setting's slot on the x axis
MAX_BAR_WIDTH = 0.5
SETTING_INCHES = 1.4
BAR_INCHES = 0.7
HOW_TO_READ = (
    "bars: ours / the reference (medians), or ours in its unit where there is no reference; whiskers: ours' p10-p90; "
    "numbers: the ratio, then ours / the reference"
)


@dataclass(frozen=True)
class _Panel:
    title: str
    rows: list[Row]
    ratio: bool  # ours / reference, else ours in its unit
    by_metric: bool  # a bar per metric and setting (ONE_PANEL), else a bar per setting


def _num(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _series_and_tick(scenario: str, row: Row, by_metric: bool) -> tuple[str, str]:
    if scenario in SERIES:
        return SERIES[scenario](row)
    return row.config, f"{row.metric}, {row.variant}" if by_metric else row.variant


def _reference_name(rows: list[Row]) -> str:
    """The rows' common reference, with N for the numbers that differ per setting ('local HF model, batch N');
    'each setting's reference' where the names differ in more than numbers."""
    names = list(dict.fromkeys(row.reference_name for row in rows if row.reference is not None))
    parts = [re.split(r"(\d+(?:\.\d+)?)", name) for name in names]  # words at even places, numbers at odd
    if len({len(p) for p in parts}) != 1 or len({tuple(p[::2]) for p in parts}) != 1:
        return "each setting's reference"
    return "".join(pieces[0] if i % 2 == 0 or len(set(pieces)) == 1 else "N" for i, pieces in enumerate(zip(*parts)))


def _panels(scenario: str, rows: list[Row]) -> list[_Panel]:
    """The bar panels of a scenario's figure, in the order of its rows."""
    by_metric: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_metric[row.metric].append(row)
    found = []
    if scenario in ONE_PANEL:
        ratios = [row for row in rows if row.ratio is not None]
        if ratios:
            found.append(_Panel(f"ours / {_reference_name(ratios)}", ratios, True, True))
        by_metric = {metric: group for metric, group in by_metric.items() if all(r.ratio is None for r in group)}
    for metric, group in by_metric.items():
        ratio = any(row.ratio is not None for row in group)
        unit = group[0].unit
        title = f"{metric} ({unit}): ours / {_reference_name(group)}" if ratio else f"{metric} ({unit})"
        found.append(_Panel(title, group, ratio, False))
    return found


def scenario_figure(scenario: str, rows: list[Row], *, title: str, run: str, footnote: str = ""):
    """The figure of one scenario of one run (a matplotlib Figure, not saved).

    Args:
        scenario: the rows' scenario; picks its layout (SERIES, ONE_PANEL).
        rows: that scenario's rows, all from the same run.
        title: what the scenario measures.
        run: which run, e.g. "full run of 2026-12-02 11:59"; goes in the title.
        footnote: a line under the figure (the machine, say).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = [row for row in rows if row.extra.get("curves")]
    bar_panels = _panels(scenario, rows)
    placements = [_place(scenario, panel) for panel in bar_panels]
    # inches per setting: room for its wrapped label and for the numbers over each of its bars
    widest = max((len(p.ticks) * max(SETTING_INCHES, BAR_INCHES * p.per_tick) for p in placements), default=0.0)
    width = min(24.0, max(8.0, widest + 4.0, 5.5 * len(curves)))
    heights = [3.6] * bool(curves) + [3.4] * len(bar_panels)
    fig = Figure(figsize=(width, sum(heights) + 1.0), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: nothing global to switch or close
    grid = fig.add_gridspec(len(heights), max(1, len(curves)), height_ratios=heights)
    if curves:
        _draw_curves([fig.add_subplot(grid[0, i]) for i in range(len(curves))], curves)
    for i, (panel, placed) in enumerate(zip(bar_panels, placements)):
        _draw_bars(fig.add_subplot(grid[i + bool(curves), :]), panel, placed)
    fig.suptitle(f"{title}\n{run}", fontsize=11)
    fig.supxlabel("\n".join(line for line in (HOW_TO_READ, footnote) if line), fontsize=7, color="dimgray")
    return fig


def _draw_curves(axes, rows: list[Row]) -> None:
    for ax, row in zip(axes, rows):
        for label, losses in row.extra["curves"].items():
            thin = label.startswith("trainer")
            ax.plot(
                range(1, len(losses) + 1),
                losses,
                label=label,
                linewidth=0.8 if thin else 1.8,
                linestyle=":" if thin else ("--" if label.startswith("swarm") else "-"),
            )
        ax.set_title(textwrap.fill(row.variant, 60), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss ({row.unit})")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)  # the curves fall from the upper left
    for ax in axes[1:]:
        ax.sharey(axes[0])


def _draw_bars(ax, panel: _Panel, placed: _Placement) -> None:
    width = placed.width
    colors = {name: f"C{i % 10}" for i, name in enumerate(placed.series)}
    bounds = _draw_targets(ax, panel, placed.x, width)
    series_handles = {}
    tops = []
    for row, x, series in zip(panel.rows, placed.x, placed.series_of):
        value, low, high = _bar(row, panel.ratio)
        bars = ax.bar(x, value, width, color=colors[series], yerr=[[low], [high]], capsize=3, error_kw={"lw": 0.8})
        series_handles.setdefault(series, bars)
        tops.append(value + high)
    if panel.ratio:
        ax.axhline(1.0, color="gray", linewidth=0.8, label="1x: ours = the reference", zorder=0)
    y_max = 1.3 * max([*tops, *(y for ys in bounds for y in ys), 1.0 if panel.ratio else 0.0]) or 1.0
    mixed_units = len({row.unit for row in panel.rows}) > 1
    for row, x, top, ys in zip(panel.rows, placed.x, tops, bounds):
        # the numbers go over the whisker, and over a target line just above it rather than across it
        near = [y for y in ys if top <= y < top + 0.15 * y_max]
        ax.annotate(
            _bar_text(row, panel.ratio, mixed_units),
            (x, max([top, *near])),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=6.5,
            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
        )
    ax.set_ylim(0, y_max)
    ax.set_xticks(range(len(placed.ticks)))
    ax.set_xticklabels([textwrap.fill(tick, 22) for tick in placed.ticks], fontsize=7)
    ax.set_xlim(-0.6, len(placed.ticks) - 0.4)
    ax.set_ylabel("ours / reference" if panel.ratio else panel.rows[0].unit, fontsize=8)
    ax.set_title(panel.title, fontsize=9)
    # the series first, then the lines (1x, targets)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        [*series_handles.values(), *handles],
        [textwrap.fill(label, 40) for label in [*series_handles, *labels]],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7.5,
        frameon=False,
    )


@dataclass
class _Placement:
    """Where the bars of a panel go; `x` and `series_of` follow the panel's rows."""

    x: list[float]  # each row's bar centre
    series_of: list[str]
    ticks: dict[str, list[int]]  # the x axis, in the order of the rows: its label -> the rows there
    series: list[str]

    @property
    def per_tick(self) -> int:
        """The most bars at one setting."""
        return max(len(at) for at in self.ticks.values())

    @property
    def width(self) -> float:
        """Of one bar, in settings."""
        return min(MAX_BAR_WIDTH, BAR_AREA / self.per_tick)


def _place(scenario: str, panel: _Panel) -> _Placement:
    """Bars of one setting side by side around its tick, one per series present there."""
    ticks: dict[str, list[int]] = {}
    series_of = []
    for i, row in enumerate(panel.rows):
        name, tick = _series_and_tick(scenario, row, panel.by_metric)
        ticks.setdefault(tick, []).append(i)
        series_of.append(name)
    placed = _Placement([0.0] * len(panel.rows), series_of, ticks, list(dict.fromkeys(series_of)))
    for position, at in enumerate(ticks.values()):
        for slot, i in enumerate(at):
            placed.x[i] = position + (slot - (len(at) - 1) / 2) * placed.width
    return placed


def _bar(row: Row, ratio: bool) -> tuple[float, float, float]:
    """Height and whiskers (down, up) of a row's bar."""
    if ratio and row.ratio is None:
        return 0.0, 0.0, 0.0  # no reference, no ratio: its text says so
    ours = row.ours
    scale = 1.0 / row.reference.median if ratio else 1.0
    return ours.median * scale, max(0.0, (ours.median - ours.p10) * scale), max(0.0, (ours.p90 - ours.median) * scale)


def _bar_text(row: Row, ratio: bool, with_unit: bool) -> str:
    unit = f" {row.unit}" if with_unit else ""
    if ratio and row.ratio is not None:
        text = f"{row.ratio:.2f}x\n{_num(row.ours.median)} / {_num(row.reference.median)}{unit}"
    elif ratio:
        text = f"{_num(row.ours.median)}{unit}\nno reference"
    else:
        text = f"{_num(row.ours.median)}{unit}"
    if row.met is not None:
        text += "\npass" if row.met else "\nMISS"
    return text


def _target_y(target: Target, row: Row, ratio: bool) -> list[float]:
    """Where a row's target lies on its panel's axis (a band: both edges); empty where it cannot be drawn there."""
    reference = row.reference.median if row.reference is not None and row.reference.median else None
    if target.on == "ratio":
        if not ratio:
            return []
        return [target.low, target.bound] if isinstance(target, Band) else [target.bound]
    if target.on == "excess":
        if reference is None:
            return []
        return [(reference + target.bound) / reference] if ratio else [reference + target.bound]
    if ratio:
        return [] if reference is None else [target.bound / reference]
    return [target.bound]


def _target_group(target: Target) -> str:
    """Targets drawn under one legend entry: a ratio target by its text; bounds in a unit (one per setting, like
    a peer's memory budget) by their text with the numbers left out."""
    return target.text if target.on == "ratio" else re.sub(r"\d+(\.\d+)?", "N", target.text)


def _draw_targets(ax, panel: _Panel, x: list[float], width: float) -> list[list[float]]:
    """Each target of the panel as a line over the bars it holds for (across the panel if it holds for all at the
    same height); returns the heights drawn over each bar."""
    heights = [_target_y(row.target, row, panel.ratio) if row.target else [] for row in panel.rows]
    groups: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(panel.rows):
        if heights[i]:
            groups[_target_group(row.target)].append(i)
    for style_index, group in enumerate(groups.values()):
        style = {
            "color": "black",
            "linestyle": TARGET_STYLES[style_index % len(TARGET_STYLES)],
            "linewidth": 1.2,
            "gid": "target",
        }
        texts = list(dict.fromkeys(panel.rows[i].target.text for i in group))
        label = f"target {texts[0]}" if len(texts) == 1 else f"target per setting, e.g. {texts[0]}"
        if len(group) < len(panel.rows):
            label += f" ({len(group)} of {len(panel.rows)} bars)"
        levels = {tuple(heights[i]) for i in group}
        if len(group) == len(panel.rows) and len(levels) == 1:
            for j, y in enumerate(levels.pop()):
                ax.axhline(y, label=None if j else label, **style)
            continue
        half = 0.65 * width
        first = True
        for i in group:
            for y in heights[i]:
                ax.hlines(y, x[i] - half, x[i] + half, label=label if first else None, **style)
                first = False
    return heights
