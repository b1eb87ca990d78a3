"""The results folder: results.json (everything), results.md (a table per scenario) and one PNG per scenario.

A scenario in SELF_PLOTTED draws its own PNG (train_swarm: loss curves); the others get bar charts here.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path

from bench.stats import Row
from swarm.extras import EXTRAS, install_hint, missing_modules

logger = logging.getLogger(__name__)

TITLES = {
    "decode": "Decode latency (batch 1, greedy)",
    "prefill": "Prefill",
    "train": "Forward+backward (blocks frozen)",
    "wire": "Wire overhead per hop",
    "concurrency": "Concurrent clients",
    "api": "OpenAI-compatible API vs the Python client",
    "startup": "Peer startup and memory",
    "wan": "A wide-area network, emulated: per-token latency vs its floor",
    "train_swarm": "Training with the swarm (peers + trainers) vs local",
}
SELF_PLOTTED = {"train_swarm"}


def _num(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _cell(summary) -> str:
    if summary is None:
        return "-"
    if summary.n == 1:
        return _num(summary.median)
    return f"{_num(summary.median)} [{_num(summary.p10)}-{_num(summary.p90)}]"


def _met(row: Row) -> str:
    return {True: "pass", False: "**miss**", None: "-" if row.target is None else "n/a"}[row.met]


def markdown(rows: list[Row], header: dict) -> str:
    lines = [f"# swarmlm bench: {header['mode']} run, {header['started']}", ""]
    lines += [f"- {key}: {value}" for key, value in header["summary"].items()]
    lines.append("")
    lines.append("Cells: median [p10-p90] over repeated runs; ratio = ours / reference (medians).")
    by_scenario: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_scenario[row.scenario].append(row)
    for scenario, group in by_scenario.items():
        lines += ["", f"## {TITLES.get(scenario, scenario)}", ""]
        loads = [r.extra.get("outside_load_cores") for r in group if r.extra.get("outside_load_cores") is not None]
        if loads:
            lines += [
                f"Other processes on this machine kept {min(loads):.2f}-{max(loads):.2f} cores busy meanwhile.",
                "",
            ]
        lines.append("| model | setting | metric | ours | reference | ratio | target | met |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for row in group:
            reference = f"{_cell(row.reference)} ({row.reference_name})" if row.reference is not None else "-"
            ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
            lines.append(
                f"| {row.config} | {row.variant} | {row.metric} ({row.unit}) | {_cell(row.ours)} | "
                f"{reference} | {ratio} | {row.target.text if row.target else '-'} | {_met(row)} |"
            )
        notes = list(dict.fromkeys(note for row in group for note in row.extra.get("notes", ())))
        if notes:
            lines += [""] + [f"- {note}" for note in notes]
    if header.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in header["errors"]]
    if header.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in header["notes"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], out_dir: Path) -> list[Path]:
    """One PNG per scenario: for each metric, ours vs reference per setting, with p10-p90 error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    by_scenario: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_scenario[row.scenario].append(row)
    for scenario, group in by_scenario.items():
        if scenario in SELF_PLOTTED:
            if (out_dir / f"{scenario}.png").is_file():
                written.append(out_dir / f"{scenario}.png")
            continue
        metrics: dict[str, list[Row]] = defaultdict(list)
        for row in group:
            metrics[f"{row.metric} ({row.unit})"].append(row)
        fig, axes = plt.subplots(len(metrics), 1, figsize=(10, 3.2 * len(metrics)), squeeze=False)
        for ax, (metric, metric_rows) in zip(axes[:, 0], metrics.items()):
            labels = [f"{r.config}\n{r.variant}" for r in metric_rows]
            xs = range(len(metric_rows))
            width = 0.38
            ours = [r.ours for r in metric_rows]
            ax.bar(
                [x - width / 2 for x in xs],
                [s.median for s in ours],
                width,
                label="ours",
                yerr=_errors(ours),
                capsize=3,
            )
            refs = [r.reference for r in metric_rows]
            if any(ref is not None for ref in refs):
                names = sorted({r.reference_name for r in metric_rows if r.reference is not None})
                ax.bar(
                    [x + width / 2 for x in xs],
                    [ref.median if ref else 0 for ref in refs],
                    width,
                    label=" / ".join(names),
                    yerr=_errors(refs),
                    capsize=3,
                )
            bounds = [(x, r.target.bound) for x, r in zip(xs, metric_rows) if r.target and r.target.on == "value"]
            if bounds:
                ax.scatter(
                    [x for x, _ in bounds],
                    [b for _, b in bounds],
                    marker="_",
                    s=900,
                    color="black",
                    label="target bound",
                    zorder=3,
                )
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, fontsize=7)
            ax.set_title(f"{TITLES.get(scenario, scenario)}: {metric}", fontsize=10)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{scenario}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _errors(summaries) -> list[list[float]]:
    low = [max(0.0, s.median - s.p10) if s else 0.0 for s in summaries]
    high = [max(0.0, s.p90 - s.median) if s else 0.0 for s in summaries]
    return [low, high]


def write(out_dir: Path, rows: list[Row], header: dict) -> dict[str, Path]:
    """Write results.json, results.md and the plots; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    payload = {**header, "rows": [row.to_json() for row in rows]}
    paths["json"].write_text(json.dumps(payload, indent=1, default=str, allow_nan=True))
    paths["markdown"].write_text(markdown(rows, header))
    if missing_modules(EXTRAS["bench"]):  # the tables and JSON are written all the same
        logger.warning("matplotlib is missing: no plots written; install them with %s", install_hint("bench"))
        return paths
    for path in plot(rows, out_dir):
        paths[path.stem] = path
    return paths
