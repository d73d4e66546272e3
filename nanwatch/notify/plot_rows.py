"""The rows `nanwatch plot` draws: metrics of an incident's run around its origin, its
baseline run's for a slowdown, and the allocator's numbers for an out-of-memory incident.

Plain dicts, one per logged iteration (``series`` tells which run, or ``"oom"``), so that the
Slack sink can read them with the store open and draw them later.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Mapping
from typing import Any

BEFORE = 200  # steps shown before the origin
AFTER = 100
_COLUMNS = (
    "rank",
    "step",
    "stage",
    "time",
    "loss",
    "grad_norm",
    "step_time",
    "data_time",
    "memory",
)


def metrics_for(conn: sqlite3.Connection, incident: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Metric rows of the incident's run around its origin (every rank, every stage), and for a
    slowdown measured against another run, that run's training rows over the same steps
    (``series`` is ``"baseline"`` on those, ``"current"`` on the others)."""
    row = conn.execute(
        "SELECT run_id FROM incidents WHERE id = ?", (incident.get("id"),)
    ).fetchone()
    if row is None or row[0] is None:
        return []
    run_id = row[0]
    origin = incident.get("origin") or {}
    step = origin.get("step")
    if step is None:
        last = conn.execute(
            "SELECT max(step) FROM metrics WHERE run_id = ? AND step IS NOT NULL", (run_id,)
        ).fetchone()[0]
        if last is None:
            return []
        lo, hi = last - BEFORE - AFTER, last
    else:
        lo, hi = step - BEFORE, step + AFTER
    out = _rows(conn, run_id, lo, hi, "current", train_only=False)
    if incident.get("kind") == "oom":
        out += _oom_row(conn, incident)
    against = origin.get("against")
    if incident.get("kind") == "slowdown" and against and against != "own":
        base = conn.execute(
            "SELECT id FROM runs WHERE name = ? AND id != ? ORDER BY id DESC LIMIT 1",
            (against, run_id),
        ).fetchone()
        if base is not None:
            out += _rows(conn, base[0], lo, hi, "baseline", train_only=True)
    return out


def _rows(
    conn: sqlite3.Connection, run_id: int, lo: int, hi: int, series: str, *, train_only: bool
) -> list[dict[str, Any]]:
    stage = "AND (stage IS NULL OR stage = 'train') " if train_only else ""
    cur = conn.execute(
        f"SELECT {', '.join(_COLUMNS)} FROM metrics WHERE run_id = ? AND step BETWEEN ? AND ? "
        f"{stage}ORDER BY rank, step, id LIMIT 50000",
        (run_id, lo, hi),
    )
    return [dict(zip(_COLUMNS, r), series=series) for r in cur]


def _oom_row(conn: sqlite3.Connection, incident: Mapping[str, Any]) -> list[dict[str, Any]]:
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
    out = dict(zip(("rank", "step", "stage"), row[:3]), time=origin.get("time"), series="oom")
    return [{**out, **mib}]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
