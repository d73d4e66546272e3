"""The incident pictures: one renderer for `nanwatch plot` and the Slack thread, per kind.

The seed case (an OOM in validation, then a 3.3x slower relaunch whose gradients go NaN) is
scanned once into a real database; the figures are inspected through matplotlib's artists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import demo_scenario
from nanwatch.notify.plot import PlotRow, build_figure, metrics_for, render_png
from nanwatch.query import incident_dict, list_incidents
from nanwatch.store import Store

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def seed_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("seed")
    db = base / "nanwatch.db"
    store = Store.open(db)
    try:
        for run in demo_scenario(base):
            run.write()
            Pipeline(Config(), store, [str(run.launch_dir)]).scan()
    finally:
        store.close()
    return db


@pytest.fixture
def incidents(seed_db: Path) -> Iterator[dict[str, tuple[dict[str, Any], list[PlotRow]]]]:
    store = Store.open(seed_db, readonly=True)
    try:
        out = {}
        for inc in list_incidents(store._conn):
            full = incident_dict(store._conn, inc["id"])
            assert full is not None
            out[inc["kind"]] = (full, metrics_for(store, full))
        yield out
    finally:
        store.close()


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def lines(fig: Figure) -> list[Line2D]:
    return [ln for ln in fig.findobj(Line2D) if ln.get_gid()]


def test_every_kind_of_the_seed_case_renders_a_png(incidents: dict[str, Any]) -> None:
    assert sorted(incidents) == ["nan", "oom", "slowdown"]
    for inc, rows in incidents.values():
        png = render_png(inc, rows)
        assert png[:8] == PNG and len(png) > 10_000


def test_no_unknown_part_is_printed(incidents: dict[str, Any]) -> None:
    # the slowdown's origin has no rank: its label must not say "rank None"
    for inc, rows in incidents.values():
        fig = build_figure(inc, rows)
        fig.canvas.draw()
        assert not [t for t in texts(fig) if "None" in t], inc["kind"]


def test_the_whole_title_fits_the_figure(incidents: dict[str, Any]) -> None:
    for inc, rows in incidents.values():
        fig = build_figure(inc, rows)
        fig.canvas.draw()
        title = fig.get_suptitle()
        assert title.replace("\n", " ") == f"Incident #{inc['id']}: {inc['title']}"
        box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())  # type: ignore[union-attr,attr-defined]
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (inc["kind"], box)


def test_the_origin_rank_stands_out_and_the_legend_stays_off_the_data(
    incidents: dict[str, Any],
) -> None:
    inc, rows = incidents["nan"]
    fig = build_figure(inc, rows)
    assert len(fig.axes) == 3  # loss, grad norm, step time
    per_rank = lines(fig)
    origin = [ln for ln in per_rank if ln.get_gid() == "rank 6"]
    others = [ln for ln in per_rank if ln.get_gid() != "rank 6"]
    assert len(origin) == 3 and len(others) == 3 * 7
    assert {to_rgba(ln.get_color()) for ln in origin}.isdisjoint(
        {to_rgba(ln.get_color()) for ln in others}
    )
    assert len({to_rgba(ln.get_color()) for ln in others}) == 1  # all grey
    assert min(ln.get_linewidth() for ln in origin) > max(ln.get_linewidth() for ln in others)
    # one compact legend for the figure, none inside a panel
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert "rank 6 (origin)" in labels and "other ranks 0-5,7" in labels
    assert "origin: rank 6, step 163, stage train" in labels
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))


def test_the_slowdown_shows_its_baseline_run(incidents: dict[str, Any]) -> None:
    inc, rows = incidents["slowdown"]
    assert inc["origin"]["against"].endswith("20261130_101500")
    assert {r.series for r in rows} == {"current", "baseline"}
    fig = build_figure(inc, rows)
    step_ax = fig.axes[0]
    assert step_ax.get_ylabel() == "step time (s)"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "baseline run 20261130_101500 (ranks 0-7)" in labels
    assert "this run (ranks 0-7)" in labels
    base = [
        ln for ln in lines(fig) if str(ln.get_gid()).startswith("baseline") and ln.axes is step_ax
    ]
    assert len(base) == 8
    assert all(0.8 < y < 0.95 for ln in base for y in ln.get_ydata())  # type: ignore[union-attr]
    # the two medians as horizontal lines, and what they mean in words
    flat = {
        round(float(ln.get_ydata()[0]), 4)  # type: ignore[index]
        for ln in step_ax.get_lines()
        if not ln.get_gid() and len(set(ln.get_ydata())) == 1  # type: ignore[arg-type]
    }
    o = inc["origin"]
    assert 0.8 < o["baseline"] < 0.95 and 2.6 < o["current"] < 3.1
    assert {round(o["baseline"], 4), round(o["current"], 4)} <= flat
    assert f"{o['baseline']:.3g} s -> {o['current']:.3g} s ({o['ratio']:.1f}x)" in texts(fig)


def test_the_oom_has_a_memory_panel_with_validation_shaded(incidents: dict[str, Any]) -> None:
    import matplotlib.dates as mdates
    from matplotlib.patches import Rectangle

    inc, rows = incidents["oom"]
    fig = build_figure(inc, rows)
    assert [ax.get_ylabel() for ax in fig.axes] == ["memory (MiB)", "loss", "step time (s)"]
    mem = fig.axes[0]
    assert mem.get_xlabel() == "" and fig.axes[-1].get_xlabel() == "time (UTC)"
    val_times = sorted(mdates.date2num(_utc(r.time)) for r in rows if r.stage == "val")
    oom_at = mdates.date2num(_utc(inc["origin"]["time"]))
    spans = [p for p in mem.patches if isinstance(p, Rectangle) and p.get_label() == "validation"]
    assert len(spans) == 1
    x0, x1 = spans[0].get_x(), spans[0].get_x() + spans[0].get_width()
    assert x0 < val_times[0] and x1 >= max(val_times[-1], oom_at) - 1e-9
    # the OOM's moment is marked on the memory panel, at the origin's time
    marks = [ln for ln in mem.get_lines() if ln.get_label().startswith("out of memory")]
    assert len(marks) == 1
    assert abs(mdates.date2num(marks[0].get_xdata()[0]) - oom_at) < 1e-6  # type: ignore[index]
    assert "rank 3" in marks[0].get_label() and "stage val" in marks[0].get_label()
    origin = [ln for ln in lines(fig) if ln.get_gid() == "rank 3" and ln.axes is mem]
    assert len(origin) == 1 and len(origin[0].get_xdata()) > 3  # type: ignore[arg-type]


def _utc(text: str) -> Any:
    import datetime as dt

    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_the_oom_panel_shows_what_the_allocator_said(incidents: dict[str, Any]) -> None:
    inc, rows = incidents["oom"]
    (said,) = [r for r in rows if r.series == "oom"]
    # MiB, as mmengine logs
    assert said.rank == 3 and said.allocated is not None and round(said.allocated) == 58696
    fig = build_figure(inc, rows)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {
        "device total 61 GiB",
        "allocated at the failure 57.3 GiB",
        "tried to allocate 1.17 GiB",
    } <= set(labels)
    # seconds of validation after minutes of training stay visible: at least a tenth of the axis
    mem = fig.axes[0]
    (span,) = [p for p in mem.patches if p.get_label() == "validation"]
    lo, hi = mem.get_xlim()
    assert span.get_width() / (hi - lo) > 0.1  # type: ignore[attr-defined]


def _row(t: str, stage: str, step: int, rank: int | None = 0) -> PlotRow:
    """A metrics row as metrics_for returns it."""
    return PlotRow(
        series="current",
        rank=rank,
        step=step,
        stage=stage,
        time=f"2026-11-30T{t}.000Z",
        loss=1.0,
        grad_norm=1.0,
        step_time=0.5,
        data_time=0.01,
        memory=900.0 if stage == "val" else 1000.0,
    )


def test_a_log_without_rank_numbers_says_nothing_of_ranks() -> None:
    rows = [_row(f"10:00:{s:02d}", "train", s, rank=None) for s in range(10, 60, 10)]
    inc = {"id": 4, "kind": "nan", "title": "NaN loss", "origin": {"rank": None, "step": 30}}
    fig = build_figure(inc, rows)
    fig.canvas.draw()
    assert not [t for t in texts(fig) if "None" in t or "rank" in t]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["this run", "origin: step 30"]


def test_validation_spans_follow_the_clock_across_the_hour() -> None:
    import matplotlib.dates as mdates

    rows = [
        _row("09:59:40", "train", 10),
        _row("09:59:50", "train", 20),
        _row("09:59:58", "val", 20),
        _row("10:00:04", "val", 20),
        _row("10:00:10", "train", 30),
        _row("10:00:20", "train", 40),
        _row("10:00:27", "val", 40),
    ]
    inc = {
        "id": 7,
        "kind": "oom",
        "title": "Out of memory on rank 0 in validation",
        "origin": {"rank": 0, "step": 40, "stage": "val", "time": "2026-11-30T10:00:30.000Z"},
    }
    fig = build_figure(inc, rows)
    spans = sorted(
        (p.get_x(), p.get_x() + p.get_width())  # type: ignore[attr-defined]
        for p in fig.axes[0].patches
        if p.get_label() in ("validation", "_validation")
    )
    at = [mdates.date2num(_utc(f"2026-11-30T{t}Z")) for t in ("09:59:50", "10:00:04")]
    assert len(spans) == 2
    assert spans[0] == pytest.approx(at, abs=1e-7)  # dates are days: 1e-7 is 9 ms
    # the second runs from the last training row to the failure, after the last val row
    assert spans[1] == pytest.approx(
        [mdates.date2num(_utc(f"2026-11-30T{t}Z")) for t in ("10:00:20", "10:00:30")],
        abs=1e-7,
    )
