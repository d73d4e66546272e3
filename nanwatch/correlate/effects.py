"""Incidents that are effects of another one: exits a communication failure caused.

The correlator asks, after each batch, which open process-failure incident of a run is really
another incident's effect (see ``chains.py`` for the evidence): its root exit is one that a
watchdog's timeout on the same rank caused, read before that timeout; or every exit in it is
one the launcher reported again, by global rank, in another incident (torchrun prints
``failed (exitcode: 1) local_rank: 2 (pid: 31106)`` and then, in its summary, ``rank : 6
(local_rank: 2)``; the first names only the local rank).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from ..store.db import Store
from ..store.records import EVENT_COLUMNS
from .chains import Root, may_be_torn_down, roots_of_run, torn_down


def comm_events_of(conn: sqlite3.Connection, ev: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's correlated communication failures that could be ``ev``'s process's."""
    rank = ev.get("rank") if ev.get("rank") is not None else ev.get("local_rank")
    rows = conn.execute(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE run_id IS ? AND kind IN "
        "('comm_timeout', 'comm_error') AND incident_id IS NOT NULL "
        "AND (? IS NULL OR rank IS NULL OR rank = ? OR local_rank = ?) ORDER BY id LIMIT 500",
        (ev["run_id"], rank, rank, rank),
    ).fetchall()
    return [Store._event(r) for r in rows]


def root_exit(conn: sqlite3.Connection, root: Root) -> dict[str, Any] | None:
    """The root event of a process-failure root, if it is an exit a failure could cause."""
    if root.kind != "process_failure" or root.event_id is None:
        return None
    row = conn.execute(f"SELECT {EVENT_COLUMNS} FROM events WHERE id = ?", (root.event_id,))
    found = row.fetchone()
    ev = Store._event(found) if found else None
    return ev if ev is not None and may_be_torn_down(ev) else None


def torn_down_by(conn: sqlite3.Connection, root: Root, ev: Mapping[str, Any]) -> bool:
    """Is ``root`` (a process failure) the exit that communication failure ``ev`` caused?"""
    exit_ev = root_exit(conn, root)
    return exit_ev is not None and torn_down(exit_ev, ev)


def _open(conn: sqlite3.Connection, incident_id: Any) -> bool:
    row = conn.execute("SELECT status FROM incidents WHERE id = ?", (incident_id,)).fetchone()
    return row is not None and row[0] == "open"


def next_effect(conn: sqlite3.Connection, run_id: Any) -> tuple[int, int] | None:
    """(an open incident of the run, the open incident it is an effect of), or None."""
    for root in roots_of_run(conn, run_id):
        exit_ev = root_exit(conn, root)
        if exit_ev is None:
            continue
        for other in comm_events_of(conn, exit_ev):
            dst = other["incident_id"]
            if dst != root.incident_id and torn_down(exit_ev, other) and _open(conn, dst):
                return root.incident_id, int(dst)
    return _repeated_report(conn, run_id)


def _repeated_report(conn: sqlite3.Connection, run_id: Any) -> tuple[int, int] | None:
    """A process-failure incident whose every exit (node, pid) is in another open incident."""
    rows = conn.execute(
        "SELECT e.incident_id, e.node, json_extract(e.fields, '$.pid'), i.kind "
        "FROM events e JOIN incidents i ON i.id = e.incident_id WHERE e.run_id IS ? "
        "AND e.kind = 'process_failure' AND i.status = 'open'",
        (run_id,),
    ).fetchall()
    where: dict[tuple[Any, Any], set[int]] = {}
    for iid, node, pid, _kind in rows:
        if pid is not None:
            where.setdefault((node, pid), set()).add(iid)
    for iid in sorted({r[0] for r in rows if r[3] == "process_failure"}):
        kinds = conn.execute(
            "SELECT DISTINCT kind FROM events WHERE incident_id = ?", (iid,)
        ).fetchall()
        mine = [(n, p) for i, n, p, _k in rows if i == iid]
        if kinds != [("process_failure",)] or any(p is None for _n, p in mine):
            continue
        others = set.intersection(*(where[k] - {iid} for k in mine)) if mine else set()
        if others:
            return iid, min(others)
    return None
