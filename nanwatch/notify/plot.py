"""`nanwatch plot`: the training metrics around an incident, drawn for its kind.

- NaN and the rest: loss, grad norm and step time per rank, the origin rank in colour, the
  others thin and grey, non-finite values as red crosses, the origin's step a dashed line;
- slowdown: step time (and data time) of the slow run beside its baseline run, with the
  baseline and current medians as horizontal lines ("0.865 s -> 2.86 s (3.3x)");
- OOM: a memory panel above loss and step time, on a time axis so that validation (which
  does not advance the step) shows as a shaded span, the OOM's time marked.

matplotlib is an optional extra (``pip install 'nanwatch[plot]'``), imported on first use; the
Slack sink attaches the same picture to an incident's thread when it is installed.
"""

from __future__ import annotations

import datetime as _dt
import io
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import NanwatchError
from ..events import parse_utc, ranks_text
from ..render import where_text
from .plot_rows import PlotRow, finite, metrics_for

__all__ = ["PlotRow", "PlotUnavailable", "build_figure", "metrics_for", "render_png"]

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_RANKS = 16  # more lines than this is a texture, not a plot
_LABELS = {
    "loss": "loss",
    "grad_norm": "grad norm",
    "step_time": "step time (s)",
    "data_time": "data time (s)",
    "memory": "memory (MiB)",  # mmengine's `memory:` is max_memory_allocated() / 2**20
}
_ORIGIN = "tab:blue"  # the origin rank; every other rank is grey
_CURRENT = "tab:orange"  # a slow run's ranks, beside its baseline run in _ORIGIN's blue
_OTHERS = "0.6"
_MARK = "tab:red"


class PlotUnavailable(NanwatchError):
    """matplotlib is not installed, or there is nothing to draw."""


def _when(text: Any) -> _dt.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return _dt.datetime.fromtimestamp(parse_utc(text), _dt.timezone.utc)
    except ValueError:
        return None


def _panels(kind: Any, rows: Sequence[PlotRow]) -> list[str]:
    """The columns to draw, in order; a column no row carries is left out."""
    if kind == "slowdown":
        wanted = ["step_time", "data_time"]
    elif kind == "oom":
        wanted = ["memory", "loss", "step_time"]
    else:
        wanted = ["loss", "grad_norm", "step_time"]
    # a NaN loss is stored as NULL: a column that is NULL everywhere may still be the story
    got = [c for c in wanted if any(r.value(c) is not None for r in rows)]
    return got or wanted[:1]


def _origin_label(kind: Any, origin: Mapping[str, Any]) -> str:
    where = where_text({k: origin.get(k) for k in ("rank", "step", "epoch", "iter", "stage")})
    when = _when(origin.get("time"))
    if kind == "oom" and when is not None:
        where = ", ".join(p for p in (where, when.strftime("%H:%M:%S UTC")) if p)
    head = {"oom": "out of memory", "slowdown": "slow from"}.get(str(kind), "origin")
    return f"{head}: {where}" if where else head


def build_figure(incident: Mapping[str, Any], rows: Sequence[PlotRow]) -> Figure:
    """The picture as a matplotlib Figure (tests inspect it); PlotUnavailable without
    matplotlib or without metrics of the incident's own run."""
    current = [r for r in rows if r.series == "current"]
    if not current:
        raise PlotUnavailable(
            f"incident {incident.get('id')}: its run has no training metrics (loss, grad norm, "
            "step time) to plot"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(
            "plotting needs matplotlib: pip install 'nanwatch[plot]' (or pip install matplotlib)"
        ) from None
    kind = incident.get("kind")
    origin = incident.get("origin") or {}
    baseline = [r for r in rows if r.series == "baseline"]
    cols = _panels(kind, current)
    # validation does not advance the step: only a time axis shows it as a span
    by_time = kind == "oom" and all(_when(r.time) for r in current)

    fig = Figure(figsize=(9, 2.3 * len(cols) + 1.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ratios = [2.0 if i == 0 and c in ("memory", "step_time") else 1.0 for i, c in enumerate(cols)]
    grid = fig.subplots(len(cols), 1, sharex=True, squeeze=False, height_ratios=ratios)
    axes: list[Axes] = list(grid[:, 0])
    ranks = _draw_ranks(axes, cols, current, baseline, origin, by_time)
    if by_time:
        span = _shade_validation(axes, current, origin)
        if span is not None:
            _zoom(axes[0], *span)
    mark = _when(origin.get("time")) if by_time else origin.get("step")
    if mark is not None:
        for i, ax in enumerate(axes):
            ax.axvline(
                mark,  # type: ignore[arg-type]  # matplotlib converts datetimes itself
                color=_MARK,
                linestyle="--",
                linewidth=1,
                label=_origin_label(kind, origin) if i == 0 else "_origin",
            )
    oom = next((r for r in rows if r.series == "oom"), None)
    if oom is not None and "memory" in cols:
        _oom_marks(axes[cols.index("memory")], oom, mark)
    if kind == "slowdown" and "data_time" in cols:
        # from zero: a flat data time a hair above it says the loader is not the cause
        ax = axes[cols.index("data_time")]
        ax.set_ylim(0, max(ax.get_ylim()[1], 0.05))
    if kind == "slowdown" and "step_time" in cols:
        _baseline_lines(axes[cols.index("step_time")], origin)
    for ax, col in zip(axes, cols):
        ax.set_ylabel(_LABELS[col])
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("time (UTC)" if by_time else "step")

    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=min(len(handles), 3),
            fontsize=8,
            frameon=False,
        )
    extra = f" ({MAX_RANKS} of {len(ranks)} ranks)" if len(ranks) > MAX_RANKS else ""
    _title(fig, f"Incident #{incident.get('id')}: {incident.get('title') or kind}{extra}")
    return fig


def _draw_ranks(
    axes: Sequence[Axes],
    cols: Sequence[str],
    current: Sequence[PlotRow],
    baseline: Sequence[PlotRow],
    origin: Mapping[str, Any],
    by_time: bool,
) -> list[Any]:
    """One line per rank and panel; returns the current run's ranks (origin first)."""
    by_rank: dict[Any, list[PlotRow]] = {}
    for r in current:
        by_rank.setdefault(r.rank, []).append(r)
    ranks = sorted(by_rank, key=lambda k: (k is None, k if k is not None else 0))
    hot = origin.get("rank")
    if hot is not None and hot in by_rank:
        ranks.remove(hot)
        ranks.insert(0, hot)
    else:
        hot = None
    shown = ranks[:MAX_RANKS]
    named = [r for r in shown if r is not None]
    base_ranks: dict[Any, list[PlotRow]] = {}
    for r in baseline:
        base_ranks.setdefault(r.rank, []).append(r)
    # runs of one experiment share the work_dir part of their names: the rest tells them apart
    base_name = str(origin.get("against") or "").rsplit("/", 1)[-1]
    base_text = ranks_text(r for r in base_ranks if r is not None)

    for ax, col in zip(axes, cols):
        bad_x: list[Any] = []
        first_other = True
        for rank in shown:
            pts = by_rank[rank]
            if by_time:
                # memory is logged in validation too; the other numbers are training's
                pts = sorted(
                    (p for p in pts if col == "memory" or p.stage in (None, "train")),
                    key=lambda p: str(p.time),
                )
                xs: list[Any] = [_when(p.time) for p in pts if finite(p.value(col))]
            else:
                pts = [p for p in pts if p.stage in (None, "train")]
                xs = [p.step for p in pts if finite(p.value(col))]
            ys: list[Any] = [p.value(col) for p in pts if finite(p.value(col))]
            # SQLite stores NaN as NULL: a logged row without the value was non-finite
            if xs and col in ("loss", "grad_norm"):
                bad_x += [
                    _when(p.time) if by_time else p.step for p in pts if not finite(p.value(col))
                ]
            if hot is not None and rank == hot:
                style: dict[str, Any] = {"color": _ORIGIN, "linewidth": 1.8, "zorder": 3}
                label = f"rank {rank} (origin)"
            elif baseline:
                style = {"color": _CURRENT, "linewidth": 0.8, "alpha": 0.7}
                text = f"this run (ranks {ranks_text(named)})" if named else "this run"
                label = text if first_other else "_rank"
                first_other = False
            else:
                others = [r for r in named if r != hot]
                style = {"color": _OTHERS, "linewidth": 0.7, "alpha": 0.7}
                head = "other ranks" if hot is not None else "ranks"
                # a log without rank numbers is one unnamed rank
                text = f"{head} {ranks_text(others)}" if others else "this run"
                label = text if first_other else "_rank"
                first_other = False
            (line,) = ax.plot(xs, ys, label=label, **style)
            line.set_gid(f"rank {rank}")
        first_base = True
        for rank, pts in sorted(base_ranks.items(), key=lambda kv: str(kv[0])):
            pts = [p for p in pts if finite(p.value(col))]
            label = f"baseline run {base_name} (ranks {base_text})" if first_base else "_baseline"
            first_base = False
            bx: list[Any] = [p.step for p in pts]
            by: list[Any] = [p.value(col) for p in pts]
            (line,) = ax.plot(
                bx,
                by,
                color=_ORIGIN,
                linewidth=0.8,
                alpha=0.7,
                label=label,
            )
            line.set_gid(f"baseline rank {rank}")
        if bad_x:
            top = ax.get_ylim()[1]
            ax.scatter(
                bad_x,
                [top] * len(bad_x),
                marker="x",
                color=_MARK,
                s=18,
                label="non-finite",
                zorder=4,
            )
    return ranks


def _shade_validation(
    axes: Sequence[Axes], rows: Sequence[PlotRow], origin: Mapping[str, Any]
) -> tuple[Any, Any] | None:
    """Shade each stretch of validation/test rows: from the last training row before it
    (validation starts when training stops; its first line comes an interval later) to its
    last row, or to the origin's time when the origin is in it and comes later. Returns the
    stretch the origin is in."""
    marks = sorted({(_when(r.time), r.stage or "train") for r in rows})
    spans: list[list[Any]] = []  # [start, end, closed by, stage]
    prev_train = None
    for when, stage in marks:
        if stage == "train":
            prev_train = when
            if spans and spans[-1][2] is None:
                spans[-1][2] = when  # the next training row closes the span
        elif spans and spans[-1][2] is None:
            spans[-1][1] = when
        else:
            spans.append([prev_train or when, when, None, stage])
    at = _when(origin.get("time"))
    found = None
    labelled: set[str] = set()
    for start, end, closed, stage in spans:
        if at is not None and start <= at and (closed is None or at < closed):
            if origin.get("stage") == stage:
                end = max(end, at)
            found = (start, end)
        name = "validation" if stage == "val" else "testing"
        for ax in axes:
            ax.axvspan(
                start,
                end,
                color="gold" if stage == "val" else "plum",
                alpha=0.25,
                zorder=0,
                label=name if name not in labelled else f"_{name}",
            )
        labelled.add(name)
    return found


def _zoom(ax: Axes, start: _dt.datetime, end: _dt.datetime) -> None:
    """A validation of seconds after hours of training would be a hairline: show the training
    before it over at most five times its length (the axes share x)."""
    from matplotlib import dates as mdates

    lo, _ = ax.get_xlim()
    width = max(end - start, _dt.timedelta(seconds=1))
    left = max(mdates.num2date(lo), start - 5 * width)  # type: ignore[no-untyped-call]
    ax.set_xlim(left, end + width * 0.3)  # type: ignore[arg-type]


def _oom_marks(ax: Axes, oom: PlotRow, at: Any) -> None:
    """At the failure: what was allocated, what was asked for on top, the device's total."""
    if at is None or oom.allocated is None:
        return
    allocated = oom.allocated
    if oom.total is not None and finite(oom.total):
        ax.axhline(
            oom.total,
            color="0.3",
            linestyle=":",
            linewidth=1.2,
            label=f"device total {oom.total / 1024:.3g} GiB",
        )
    ax.scatter(
        [at],
        [allocated],
        color=_MARK,
        marker="o",
        s=30,
        zorder=5,
        label=f"allocated at the failure {allocated / 1024:.3g} GiB",
    )
    if oom.bytes_requested is not None and finite(oom.bytes_requested):
        ax.vlines(
            at,
            allocated,
            allocated + oom.bytes_requested,
            color=_MARK,
            linewidth=4,
            zorder=5,
            label=f"tried to allocate {oom.bytes_requested / 1024:.3g} GiB",
        )


def _baseline_lines(ax: Axes, origin: Mapping[str, Any]) -> None:
    base, cur = origin.get("baseline"), origin.get("current")
    if not (finite(base) and finite(cur)) or base <= 0:  # type: ignore[operator]
        return
    base, cur = float(base), float(cur)  # type: ignore[arg-type]
    own = origin.get("against") in (None, "own")
    ax.axhline(
        base,
        color=_OTHERS if own else _ORIGIN,
        linestyle=":",
        linewidth=1.5,
        label=f"baseline {base:.3g} s" + (" (this run's steady steps)" if own else ""),
    )
    ax.axhline(cur, color=_CURRENT, linestyle=":", linewidth=1.5, label=f"slow {cur:.3g} s")
    ratio = origin.get("ratio") if finite(origin.get("ratio")) else cur / base
    ax.annotate(
        f"{base:.3g} s -> {cur:.3g} s ({ratio:.1f}x)",
        xy=(0.99, cur),
        xycoords=("axes fraction", "data"),
        xytext=(0, 4),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=9,
        fontweight="bold",
        color=_MARK,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
    )
    # from zero: the gap between the lines is then the slowdown, not the axis' choice
    ax.set_ylim(0, max(ax.get_ylim()[1], cur * 1.12))


def _title(fig: Figure, text: str) -> None:
    """The whole title, wrapped onto as many lines as the figure's width needs (at most 3)."""
    title = fig.suptitle(text, fontsize=10)
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    room = fig.bbox.width * 0.96
    width = len(text)
    while title.get_window_extent(renderer).width > room and width > 20:
        width = int(width * 0.9)
        lines = textwrap.wrap(text, width)
        if len(lines) > 3:
            lines = [*lines[:2], textwrap.shorten(" ".join(lines[2:]), width, placeholder=" …")]
        title.set_text("\n".join(lines))


def render_png(incident: Mapping[str, Any], rows: Sequence[PlotRow]) -> bytes:
    """The picture as PNG bytes; PlotUnavailable without matplotlib or metrics."""
    fig = build_figure(incident, rows)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
