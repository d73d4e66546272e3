"""Silences: hold notifications of a run and/or kind until a time (``nanwatch silence``).

A silenced incident's messages are not dropped: the outbox holds them until the silence ends,
then delivers the incident's state at that time (or nothing, if it was resolved meanwhile and
never announced).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from typing import Any

from ..events import format_utc, now_utc
from ..store.db import Store


def add_silence(
    store: Store,
    *,
    run: str | None,
    kind: str | None,
    seconds: float,
    comment: str | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    now = time.time() if now is None else now
    until = now + seconds
    with store.transaction():
        cur = store.execute(
            "INSERT INTO silences(run, kind, until, created_at, comment) VALUES (?,?,?,?,?)",
            (run, kind, until, now_utc(), comment),
        )
    return _silence((int(cur.lastrowid or 0), run, kind, until, format_utc(now), comment), now)


def _silence(row: tuple[Any, ...], now: float) -> dict[str, Any]:
    sid, run, kind, until, created, comment = row
    return {
        "id": sid,
        "run": run,
        "kind": kind,
        "until": until,
        "until_utc": format_utc(until),
        "created_at": created,
        "comment": comment,
        "active": until > now,
    }


def list_silences(
    conn: sqlite3.Connection, *, include_expired: bool = False, now: float | None = None
) -> list[dict[str, Any]]:
    now = time.time() if now is None else now
    sql = "SELECT id, run, kind, until, created_at, comment FROM silences"
    params: tuple[Any, ...] = ()
    if not include_expired:
        sql += " WHERE until > ?"
        params = (now,)
    return [_silence(r, now) for r in conn.execute(sql + " ORDER BY id", params)]


def active_silence(
    conn: sqlite3.Connection, incident: Mapping[str, Any], *, now: float | None = None
) -> dict[str, Any] | None:
    """The silence that lasts longest among those matching the incident's run and kind."""
    now = time.time() if now is None else now
    row = conn.execute(
        "SELECT id, run, kind, until, created_at, comment FROM silences "
        "WHERE until > ? AND (run IS NULL OR run = ?) AND (kind IS NULL OR kind = ?) "
        "ORDER BY until DESC LIMIT 1",
        (now, incident.get("run"), incident.get("kind")),
    ).fetchone()
    return _silence(row, now) if row else None
