"""The bench figures, drawn from a small hand-written results.json: what they show and that nothing overlaps."""

from __future__ import annotations

import json

import pytest

from bench import report
from bench.plots import scenario_figure
from bench.scenarios.train_swarm import FIDELITY_TARGET
from bench.stats import Band, Row, Summary, Target, parse_target

pytest.importorskip("matplotlib")


def _summary(median: float, spread: float = 0.0) -> dict:
    return {"median": median, "p10": median - spread, "p90": median + spread, "min": median, "max": median, "n": 3}


def _row(scenario, config, variant, metric, unit, ours, reference=None, reference_name="", target=None, **extra):
    rule = None
    if target is not None:
        on, op, bound, text = target
        rule = {"on": on, "op": op, "bound": bound, "text": text}
    return {
        "scenario": scenario,
        "config": config,
        "variant": variant,
        "metric": metric,
        "unit": unit,
        "ours": ours,
        "reference": reference,
        "reference_name": reference_name,
        "target": rule["text"] if rule else None,
        "target_rule": rule,
        "extra": extra,
    }


AT_8 = ("ratio", ">=", 4.0, ">= 4x 1 client")
RESULTS = {
    "mode": "full",
    "started": "2026-12-02T11:59:46",
    "summary": {"machine": "2 CPUs, torch 2.13.0+cpu, cpu float32"},
    "errors": [],
    "rows": [
        # two models: two series; the reference differs per setting (the old legend merged them into one entry)
        *(
            _row(
                "concurrency",
                config,
                f"3 peers, {n} clients",
                "aggregate decode vs local batch",
                "tokens/s",
                _summary(base * n**0.5, 1.0),
                _summary(base * n),
                f"local HF model, batch {n}",
                ("ratio", ">=", 0.6, ">= 0.6x local batch 8") if n == 8 else None,
            )
            for config, base in (("default", 14.0), ("tiny", 60.0))
            for n in (1, 2, 4, 8, 16)
        ),
        *(
            _row(
                "concurrency",
                "default",
                f"3 peers, {n} clients",
                "aggregate decode",
                "tokens/s",
                _summary(14.0 * n**0.5),
                _summary(14.0),
                "1 client",
                AT_8 if n == 8 else None,
            )
            for n in (1, 2, 4, 8, 16)
        ),
        # a metric without a reference, with a bound in its unit; and a results.json from before target rules
        _row("startup", "default", "3 peers, blocks 0:10", "launch to ONLINE", "s", _summary(4.7), target=None),
        {
            **_row("startup", "default", "3 peers, blocks 10:20", "launch to ONLINE", "s", _summary(4.6)),
            "target": "< 10 s",
        },
        *(
            _row(
                "wan",
                "default",
                f"3 peers, {delay} ms one-way, {route}",
                "decode step",
                "ms",
                _summary(75.0 + legs * delay * 1.05, 3.0),
                _summary(72.0 + legs * delay),
                f"floor: {legs} legs x {delay} ms + the same at 0 ms",
                ("ratio", "<=", 1.15, "<= 1.15x the floor") if route == "peer to peer" and delay else None,
            )
            for delay in (0, 10, 50)
            for route, legs in (("peer to peer", 4), ("client-driven", 6))
        ),
        {
            **_row(
                "train_swarm",
                "train-small",
                "1 trainer, 2 peers, batch 8x64, 30 steps",
                "final loss, mean of last 5 steps",
                "nats",
                _summary(6.46),
                _summary(6.45),
                "swarmlm train --local",
                curves={"local, batch 8": [10.0, 8.0, 7.0], "swarm, 1 trainer": [10.0, 8.1, 7.0]},
            ),
            "target_rule": {"on": "ratio", "op": "<=", "bound": 1.02, "text": "0.98-1.02x local", "low": 0.98},
            "target": "0.98-1.02x local",
        },
        _row(
            "train_swarm",
            "train-small",
            "1 trainer, 2 peers, batch 8x64, 30 steps",
            "training throughput",
            "tokens/s",
            _summary(431.0, 40.0),
            _summary(523.0, 60.0),
            "swarmlm train --local",
            ("ratio", ">=", 0.7, ">= 0.7x local"),
        ),
    ],
}


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "run" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(RESULTS, indent=1))
    return path


def _figure(results, scenario: str):
    rows, header = report.read(results)
    mine = [row for row in rows if row.scenario == scenario]
    fig = scenario_figure(scenario, mine, title=report.TITLES[scenario], run=report.run_label(header))
    fig.canvas.draw()  # lays the figure out, so that extents can be compared
    return fig


def _bar_axes(fig):
    return [ax for ax in fig.axes if ax.patches]


def _targets(ax) -> list:
    """The target lines of a panel: full-width ones (Line2D) and per-bar segments (LineCollection)."""
    return [artist for artist in (*ax.lines, *ax.collections) if artist.get_gid() == "target"]


def _heights(artist) -> list[float]:
    if hasattr(artist, "get_segments"):
        return [segment[0][1] for segment in artist.get_segments()]
    return [artist.get_ydata()[0]]


def _extents(artist, renderer) -> list:
    """Window extents of a target: one per segment, or the line across the panel."""
    if not hasattr(artist, "get_segments"):
        return [artist.get_window_extent(renderer)]
    from matplotlib.transforms import Bbox

    to_window = artist.get_transform()
    return [Bbox(to_window.transform(segment)) for segment in artist.get_segments()]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_a_figure_is_redrawn_from_its_results_json_alone(results, tmp_path, capsys):
    out = tmp_path / "figures"
    assert report.main(["--from", str(results), "--out", str(out)]) == 0
    expected = {f"{s}.png" for s in ("concurrency", "startup", "wan", "train_swarm")}
    assert {p.name for p in out.iterdir()} == expected
    assert all((out / name).stat().st_size > 10_000 for name in expected)
    assert sorted(capsys.readouterr().out.split()) == sorted(str(out / name) for name in expected)
    assert report.main(["--from", str(results)]) == 0  # beside the results.json by default
    assert expected <= {p.name for p in results.parent.iterdir()}
    assert report.main(["--from", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_ratio_panels_one_legend_entry_per_series_and_the_targets_drawn(results):
    fig = _figure(results, "concurrency")
    assert "Concurrent clients" in fig._suptitle.get_text()
    assert "full run of 2026-12-02 11:59" in fig._suptitle.get_text()  # pairs the figure with its table
    local, alone = _bar_axes(fig)
    assert local.get_title() == "aggregate decode vs local batch (tokens/s): ours / local HF model, batch N"
    labels = [text.get_text() for text in local.get_legend().get_texts()]
    assert labels == [
        "default",
        "tiny",
        "target >= 0.6x local batch 8 (2 of 10\nbars)",
        "1x: ours = the reference",
    ]
    # bars are ratios: default at 4 clients makes 14*2 tokens/s against 14*4
    heights = sorted(round(bar.get_height(), 3) for bar in local.patches)
    assert heights[:2] == [0.25, 0.25] and heights[-2:] == [1.0, 1.0]
    texts = [text.get_text() for text in local.texts]
    assert "0.50x\n28 / 56" in texts and "0.35x\n39.6 / 112\nMISS" in texts  # medians written on the bars
    # a target that holds for some settings is a line over each of their bars (one per model here), at its bound
    assert [_heights(artist) for artist in _targets(local)] == [[0.6], [0.6]]
    assert [(type(a).__name__, _heights(a)) for a in _targets(alone)] == [("LineCollection", [4.0])]


def test_no_legend_over_the_bars_and_no_labels_over_each_other(results):
    for scenario in ("concurrency", "wan", "startup", "train_swarm"):
        fig = _figure(results, scenario)
        renderer = fig.canvas.get_renderer()
        for ax in _bar_axes(fig):
            box = ax.get_window_extent(renderer)
            legend = ax.get_legend().get_window_extent(renderer)
            assert legend.x0 >= box.x1, f"{scenario}: the legend of {ax.get_title()!r} covers its axes"
            ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
            numbers = [t.get_window_extent(renderer) for t in ax.texts]
            for group in (ticks, numbers):
                for i, a in enumerate(group):
                    for b in group[i + 1 :]:
                        assert not _overlap(a, b), f"{scenario}: labels overlap in {ax.get_title()!r}"
            for line in _targets(ax):
                for extent in _extents(line, renderer):
                    assert not any(_overlap(extent, n) for n in numbers), f"{scenario}: a target crosses numbers"


def test_series_within_a_setting_and_bounds_in_a_unit(results):
    fig = _figure(results, "wan")
    (ax,) = _bar_axes(fig)
    assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["peer to peer", "client-driven"]
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "3 peers, 0 ms one-way",
        "3 peers, 10 ms one-way",
        "3 peers, 50 ms one-way",
    ]
    assert "floor: N legs x N ms + the same at 0 ms" in ax.get_title()  # only the numbers that differ are N

    fig = _figure(results, "startup")
    (ax,) = _bar_axes(fig)
    assert ax.get_ylabel() == "s" and [bar.get_height() for bar in ax.patches] == [4.7, 4.6]
    # the old results.json said only "< 10 s": read as a bound in seconds, drawn over the bar it holds for
    (target,) = _targets(ax)
    assert target.get_label() == "target < 10 s (1 of 2 bars)" and _heights(target) == [10.0]


def test_train_swarm_draws_its_loss_curves_and_its_band(results):
    fig = _figure(results, "train_swarm")
    curves = [ax for ax in fig.axes if ax.get_xlabel() == "step"]
    assert len(curves) == 1
    assert [line.get_label() for line in curves[0].lines] == ["local, batch 8", "swarm, 1 trainer"]
    (bars,) = _bar_axes(fig)  # its metrics share one panel of ratios, each number with its unit
    assert len(bars.get_xticklabels()) == 2
    assert [t.get_text().splitlines()[1] for t in bars.texts] == ["6.46 / 6.45 nats", "431 / 523 tokens/s"]
    # a band: both edges over its bar, under one legend entry
    assert sorted(y for artist in _targets(bars) for y in _heights(artist)) == [0.7, 0.98, 1.02]
    legend = [t.get_text().replace("\n", " ") for t in bars.get_legend().get_texts()]
    assert "target 0.98-1.02x local (1 of 2 bars)" in legend and "target >= 0.7x local (1 of 2 bars)" in legend


def test_rows_and_targets_round_trip_through_json():
    rows = [
        Row(
            "decode",
            "tiny",
            "3 peers",
            "decode step",
            "ms",
            Summary.of([12.0, 13.0]),
            Summary.of([10.0]),
            "local",
            Target("ratio", "<=", 1.25, "<= 1.25x local"),
            extra={"notes": ["n"]},
        ),
        Row(
            "train_swarm", "m", "v", "final loss", "nats", Summary.of([5.2]), Summary.of([5.0]), target=FIDELITY_TARGET
        ),
        Row("startup", "tiny", "v", "launch to ONLINE", "s", Summary.of([4.0])),
    ]
    for row in rows:
        again = Row.from_json(json.loads(json.dumps(row.to_json())))
        assert again == row and again.ratio == row.ratio and again.met == row.met
    assert isinstance(Row.from_json(rows[1].to_json()).target, Band)
    assert Row.from_json(rows[1].to_json()).met is False  # 1.04x: outside the band


@pytest.mark.parametrize(
    "text, target",
    [
        ("<= 1.15x local", Target("ratio", "<=", 1.15, "<= 1.15x local")),
        (">= 4x 1 client", Target("ratio", ">=", 4.0, ">= 4x 1 client")),
        ("0.98-1.02x local", Band("ratio", "<=", 1.02, "0.98-1.02x local", low=0.98)),
        ("<= 2 ms over gRPC direct", Target("excess", "<=", 2.0, "<= 2 ms over gRPC direct")),
        ("< 10 s", Target("value", "<", 10.0, "< 10 s")),
        ("<= 589 (share 131 + KV 7 + 450)", Target("value", "<=", 589.0, "<= 589 (share 131 + KV 7 + 450)")),
    ],
)
def test_targets_of_older_results_are_read_from_their_text(text, target):
    assert parse_target(text) == target
