"""`nanwatch plot`: loss, grad norm and step time per rank around an incident, origin marked.

matplotlib is an optional extra (``pip install 'nanwatch[plot]'``), imported on first use; the
Slack sink attaches the same picture to an incident's thread when it is installed.
"""

from __future__ import annotations

import io
import math
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import NanwatchError

BEFORE = 200  # steps shown before the origin
AFTER = 100
MAX_RANKS = 16  # more lines than this is a texture, not a plot
_SERIES = (("loss", "loss"), ("grad_norm", "grad norm"), ("step_time", "step time (s)"))


class PlotUnavailable(NanwatchError):
    """matplotlib is not installed, or there is nothing to draw."""


def metrics_for(conn: sqlite3.Connection, incident: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Training metric rows of the incident's run around its origin (every rank)."""
    row = conn.execute(
        "SELECT run_id FROM incidents WHERE id = ?", (incident.get("id"),)
    ).fetchone()
    if row is None or row[0] is None:
        return []
    run_id = row[0]
    step = (incident.get("origin") or {}).get("step")
    if step is None:
        last = conn.execute(
            "SELECT max(step) FROM metrics WHERE run_id = ? AND step IS NOT NULL", (run_id,)
        ).fetchone()[0]
        if last is None:
            return []
        lo, hi = last - BEFORE - AFTER, last
    else:
        lo, hi = step - BEFORE, step + AFTER
    cur = conn.execute(
        "SELECT rank, step, loss, grad_norm, step_time FROM metrics WHERE run_id = ? "
        "AND step BETWEEN ? AND ? AND (stage IS NULL OR stage = 'train') "
        "ORDER BY rank, step LIMIT 50000",
        (run_id, lo, hi),
    )
    keys = ("rank", "step", "loss", "grad_norm", "step_time")
    return [dict(zip(keys, r)) for r in cur]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def render_png(incident: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> bytes:
    """The picture as PNG bytes; PlotUnavailable without matplotlib or metrics."""
    if not rows:
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
    origin = incident.get("origin") or {}
    by_rank: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r)
    ranks = sorted(by_rank, key=lambda k: (k is None, k if k is not None else 0))
    if origin.get("rank") in ranks:
        ranks.remove(origin["rank"])
        ranks.insert(0, origin["rank"])
    shown = ranks[:MAX_RANKS]

    fig = Figure(figsize=(9, 7.5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(_SERIES), 1, sharex=True)
    for ax, (col, label) in zip(axes, _SERIES):
        bad_x: list[float] = []
        for rank in shown:
            pts = by_rank[rank]
            xs = [p["step"] for p in pts if _finite(p[col])]
            ys = [p[col] for p in pts if _finite(p[col])]
            # SQLite stores NaN as NULL: a logged row without the value was non-finite
            if xs:
                bad_x += [p["step"] for p in pts if not _finite(p[col])]
            is_origin = rank == origin.get("rank")
            ax.plot(
                xs,
                ys,
                linewidth=1.6 if is_origin else 0.8,
                alpha=1.0 if is_origin else 0.6,
                label=f"rank {rank}" + (" (origin)" if is_origin else ""),
            )
        if bad_x:
            top = ax.get_ylim()[1]
            ax.scatter(
                bad_x,
                [top] * len(bad_x),
                marker="x",
                color="red",
                s=18,
                label="non-finite",
                zorder=3,
            )
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if origin.get("step") is not None:
            ax.axvline(origin["step"], color="red", linestyle="--", linewidth=1)
    if origin.get("step") is not None:
        axes[0].annotate(
            f"origin: rank {origin.get('rank')}, step {origin['step']}",
            xy=(origin["step"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12),
            textcoords="offset points",
            color="red",
            fontsize=8,
        )
    axes[-1].set_xlabel("step")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[0].legend(handles, labels, fontsize=7, ncol=4, loc="upper left")
    extra = f" ({len(shown)} of {len(ranks)} ranks)" if len(ranks) > len(shown) else ""
    fig.suptitle(
        f"Incident #{incident.get('id')}: {incident.get('title', '')}{extra}"[:120], fontsize=10
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
