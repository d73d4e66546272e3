"""Where an incident started: its origin block (ARCHITECTURE.md vocabulary).

``origin_for(kind)`` returns the function that computes an incident's origin from its events.
Kinds register their own (NaN localisation across ranks and tensor families has one); the
default takes the earliest event by (step, time, rank).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from ..store.db import EVENT_COLUMNS, Store

OriginFn = Callable[[sqlite3.Connection, int], tuple[dict[str, Any] | None, dict[str, Any]]]
"""(connection, incident id) -> (the root event or None, the origin block)."""

_REGISTRY: dict[str, OriginFn] = {}


def register(kind: str) -> Callable[[OriginFn], OriginFn]:
    def deco(fn: OriginFn) -> OriginFn:
        _REGISTRY[kind] = fn
        return fn

    return deco


def origin_for(kind: str) -> OriginFn:
    return _REGISTRY.get(kind, earliest_event_origin)


def sort_key(ev: Mapping[str, Any]) -> tuple[Any, ...]:
    """Earliest first: known steps before unknown, then time, then rank, then arrival."""
    step = ev.get("step")
    return (
        0 if step is not None else 1,
        step if step is not None else 0,
        ev.get("time") or ev.get("fields", {}).get("stream_time") or "~",
        ev.get("rank") if ev.get("rank") is not None else 1 << 30,
        ev["id"],
    )


def earliest_event(conn: sqlite3.Connection, incident_id: int) -> dict[str, Any] | None:
    rows = conn.execute(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id=? "
        "ORDER BY step IS NULL, step, id LIMIT 200",
        (incident_id,),
    ).fetchall()
    if not rows:
        return None
    return min((Store._event(r) for r in rows), key=sort_key)


def origin_of(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The origin block of an incident rooted at one event."""
    f = ev.get("fields", {})
    extra = {k: f[k] for k in ("ratio", "baseline", "current", "against") if k in f}
    tensor = f.get("tensor")
    if "loss" in (f.get("tensors") or ()):
        tensor = "loss"  # a line with several non-finite terms: the total loss says it best
    return {
        **extra,
        "rank": ev.get("rank"),
        "step": ev.get("step"),
        "epoch": ev.get("epoch"),
        "iter": ev.get("iter"),
        "stage": ev.get("stage"),
        "phase": f.get("phase"),
        "tag": f.get("tag"),
        "tensor": tensor,
        "shape": f.get("shape"),
        "dtype": f.get("dtype"),
        "module": f.get("module"),
        "first_param": f.get("first_param"),
        "time": ev.get("time") or f.get("stream_time"),
        "event_id": ev.get("id"),
    }


def earliest_event_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    ev = earliest_event(conn, incident_id)
    return ev, (origin_of(ev) if ev else {})
