"""Where an incident started: its origin block (ARCHITECTURE.md vocabulary).

``origin_for(kind)`` returns the function that computes an incident's origin from its events.
Kinds register their own (NaN localisation across ranks and tensor families has one); the
default takes the earliest event by (step, time, rank).

A caused incident (an OOM or a process failure that other ranks' timeouts follow from) takes its
origin from its root event: the event of the incident's own kind that happened first, never from
one of its symptoms, whatever their steps and times say. The root moves only on evidence (another
event of the root's kind known to be earlier); an equal or unknown time keeps the one chosen.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from ..store.db import EVENT_COLUMNS, Store
from .chains import event_time

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
    # the same order as sort_key, in SQL: an incident may hold thousands of events
    row = conn.execute(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id=? "
        "ORDER BY step IS NULL, step, "
        "coalesce(time, json_extract(fields, '$.stream_time'), '~'), "
        "rank IS NULL, rank, id LIMIT 1",
        (incident_id,),
    ).fetchone()
    return Store._event(row) if row else None


def _root_key(ev: Mapping[str, Any]) -> tuple[Any, ...]:
    """Which of two events of the root's kind came first: a known time before an unknown one,
    then the time (a traceback's is the last time its stream printed), then the step; an
    event that says where it happened before one that does not."""
    t = event_time(ev)
    step = ev.get("step")
    located = ev.get("rank") is not None or ev.get("local_rank") is not None
    return (t is None, t or 0.0, step is None, step or 0, not located)


def root_event(conn: sqlite3.Connection, incident_id: int) -> dict[str, Any] | None:
    """The incident's root: its first event of the incident's own kind. The one chosen before
    stays unless another is known to be earlier (ties and missing times keep it)."""
    row = conn.execute(
        "SELECT kind, root_event_id FROM incidents WHERE id = ?", (incident_id,)
    ).fetchone()
    if row is None:
        return None
    kind, held_id = row
    evs = [
        Store._event(r)
        for r in conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id = ? AND kind = ? ORDER BY id",
            (incident_id, kind),
        )
    ]
    if not evs:
        return earliest_event(conn, incident_id)
    best = min(evs, key=_root_key)  # min keeps the first arrived of equals
    held = next((e for e in evs if e["id"] == held_id), None)
    if held is not None and not _root_key(best) < _root_key(held):
        return held
    return best


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


def root_event_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    ev = root_event(conn, incident_id)
    return ev, (origin_of(ev) if ev else {})


for _kind in ("oom", "process_failure"):
    register(_kind)(root_event_origin)
