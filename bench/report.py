"""The results folder: results.json (everything), results.md (a table per scenario) and one PNG per scenario.

The figures are drawn from the rows and the run's header alone (bench/plots.py), so they can be drawn again from a
results.json without running anything:

    python -m bench.report --from bench/results/20261202-115946/results.json --out /tmp/figures
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import sys
from collections import defaultdict
from pathlib import Path

from bench.plots import scenario_figure
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
    "speculative": "Speculative decoding (n-gram drafts) vs plain greedy, over an emulated wide-area network",
    "train_swarm": "Training with the swarm (peers + trainers) vs local",
    "offload": "Blocks streamed under memory budgets of a quarter, half and three quarters of the span vs every block resident",
    "moe": "Expert cache: hit rate and decode vs every expert resident, LRU alone and with prefetch",
}


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
    lines.append(
        "Cells: median [p10-p90] over repeated runs; ratio = ours / reference (medians), or ours - reference where "
        "the target is on that excess."
    )
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
            if row.target is not None and row.target.on == "excess" and row.reference is not None:
                unit = "points" if row.unit == "%" else row.unit
                ratio = f"{row.ours.median - row.reference.median:+.3g} {unit}"  # what the target judges
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


def run_label(header: dict) -> str:
    """Which run a figure comes from: its mode and the minute it started ("full run of 2026-12-02 11:59")."""
    started = str(header.get("started", "?"))
    try:
        started = f"{datetime.datetime.fromisoformat(started):%Y-%m-%d %H:%M}"
    except ValueError:
        pass
    return f"{header.get('mode', 'bench')} run of {started}"


def plot(rows: list[Row], out_dir: Path, header: dict) -> list[Path]:
    """One PNG per scenario of one run (bench/plots.py), its start in the title; returns their paths."""
    by_scenario: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_scenario[row.scenario].append(row)
    footnote = header.get("summary", {}).get("machine", "")
    written = []
    for scenario, group in by_scenario.items():
        fig = scenario_figure(
            scenario, group, title=TITLES.get(scenario, scenario), run=run_label(header), footnote=footnote
        )
        path = out_dir / f"{scenario}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


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
    for path in plot(rows, out_dir, header):
        paths[path.stem] = path
    return paths


def read(results_json: Path) -> tuple[list[Row], dict]:
    """The rows and the header of a results.json that `write` wrote."""
    payload = json.loads(results_json.read_text())
    rows = [Row.from_json(row) for row in payload.pop("rows")]
    return rows, payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description="Draw a run's figures from its results.")
    p.add_argument("--from", dest="source", type=Path, required=True, help="the run's results.json")
    p.add_argument("--out", type=Path, help="where the PNGs go (default: beside the results.json)")
    args = p.parse_args(argv)
    if missing_modules(EXTRAS["bench"]):
        print(f"error: drawing needs matplotlib; install it with {install_hint('bench')}", file=sys.stderr)
        return 1
    try:
        rows, header = read(args.source)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"error: cannot read {args.source} as a bench results.json: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out_dir = args.out or args.source.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in plot(rows, out_dir, header):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
