"""The rows `nanwatch plot` draws: metrics of an incident's run around its origin, its
baseline run's for a slowdown, and the allocator's numbers for an out-of-memory incident.

Frozen :class:`PlotRow` records, one per logged iteration (``series`` tells which run, or
``"oom"``), so that the Slack sink can read them with the store open and draw them later.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..store.metrics import Metrics

BEFORE = 200  # steps shown before the origin
AFTER = 100
LIMIT = 50000  # rows per series


@dataclass(frozen=True, slots=True)
class PlotRow:
    """One point of a plot: a logged iteration's numbers, or (``series="oom"``) what the
    allocator said when it failed, in MiB like mmengine's ``memory``."""

    series: str  # "current", "baseline" or "oom"
    rank: int | None
    step: int | None
    stage: str | None
    time: str | None
    loss: float | None = None
    grad_norm: float | None = None
    step_time: float | None = None
    data_time: float | None = None
    memory: float | None = None
    allocated: float | None = None
    reserved: float | None = None
    total: float | None = None
    bytes_requested: float | None = None

    def value(self, column: str) -> float | None:
        v: float | None = getattr(self, column)
        return v


def metrics_for(conn: sqlite3.Connection, incident: Mapping[str, Any]) -> list[PlotRow]:
    """Metric rows of the incident's run around its origin (every rank, every stage), and for a
    slowdown measured against another run, that run's training rows over the same steps
    (``series`` is ``"baseline"`` on those, ``"current"`` on the others)."""
    row = conn.execute(
        "SELECT run_id FROM incidents WHERE id = ?", (incident.get("id"),)
    ).fetchone()
    if row is None or row[0] is None:
        return []
    run_id = row[0]
    metrics = Metrics.reading(conn)
    origin = incident.get("origin") or {}
    step = origin.get("step")
    if step is None:
        last = metrics.last_step(run_id)
        if last is None:
            return []
        lo, hi = last - BEFORE - AFTER, last
    else:
        lo, hi = step - BEFORE, step + AFTER
    out = _rows(metrics, run_id, lo, hi, "current", train_only=False)
    if incident.get("kind") == "oom":
        out += _oom_row(conn, incident)
    against = origin.get("against")
    if incident.get("kind") == "slowdown" and against and against != "own":
        base = conn.execute(
            "SELECT id FROM runs WHERE name = ? AND id != ? ORDER BY id DESC LIMIT 1",
            (against, run_id),
        ).fetchone()
        if base is not None:
            out += _rows(metrics, base[0], lo, hi, "baseline", train_only=True)
    return out


def _rows(
    metrics: Metrics, run_id: int, lo: int, hi: int, series: str, *, train_only: bool
) -> list[PlotRow]:
    got = [
        PlotRow(
            series,
            m.rank,
            m.step,
            m.stage,
            m.time,
            m.loss,
            m.grad_norm,
            m.step_time,
            m.data_time,
            m.memory,
        )
        for m in metrics.rows([run_id], step_lo=lo, step_hi=hi)
        if not train_only or m.stage in (None, "train")
    ]
    # by rank, then step (ties in the order they were stored), as the lines are drawn
    got.sort(key=lambda r: (r.rank is not None, r.rank or 0, r.step or 0))
    return got[:LIMIT]


def _oom_row(conn: sqlite3.Connection, incident: Mapping[str, Any]) -> list[PlotRow]:
    """What the allocator said when it failed (``series`` ``"oom"``), in MiB like mmengine's
    ``memory``: allocated, requested, device total."""
    origin = incident.get("origin") or {}
    row = conn.execute(
        "SELECT rank, step, stage, fields FROM events WHERE id = ? AND kind = 'oom'",
        (origin.get("event_id"),),
    ).fetchone()
    if row is None:
        return []
    try:
        fields = json.loads(row[3])
    except ValueError:
        return []
    mib = {
        k: fields[k] / 2**20
        for k in ("allocated", "reserved", "total", "bytes_requested")
        if isinstance(fields, dict) and finite(fields.get(k))
    }
    if "allocated" not in mib:
        return []
    return [PlotRow("oom", row[0], row[1], row[2], origin.get("time"), **mib)]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
