"""The read side of the store: events, incidents and runs in the vocabulary of ARCHITECTURE.md.

Readers use their own connection (WAL) and never block the writer.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator, Sequence
from typing import Any

_EVENT_SELECT = (
    "SELECT e.id, e.kind, e.time, e.ingested_at, r.name, s.path, e.line, e.rank, e.local_rank, "
    "e.node, e.epoch, e.iter, e.step, e.stage, e.device, e.message, e.fields, e.incident_id, "
    "e.offset FROM events e LEFT JOIN runs r ON r.id = e.run_id "
    "LEFT JOIN sources s ON s.id = e.source_id"
)
_EVENT_KEYS = (
    "id",
    "kind",
    "time",
    "ingested_at",
    "run",
    "file",
    "line",
    "rank",
    "local_rank",
    "node",
    "epoch",
    "iter",
    "step",
    "stage",
    "device",
    "message",
    "fields",
    "incident",
)


def _event(row: tuple[Any, ...]) -> dict[str, Any]:
    d = dict(zip(_EVENT_KEYS, row))
    d["fields"] = json.loads(d["fields"] or "{}")
    return d


def run_names(conn: sqlite3.Connection) -> list[str]:
    return [n for (n,) in conn.execute("SELECT name FROM runs ORDER BY id")]


def _in(column: str, values: Sequence[Any]) -> str:
    return f"{column} IN ({','.join('?' * len(values))})"


def iter_events(
    conn: sqlite3.Connection,
    *,
    kind: str | None = None,
    run: str | None = None,
    runs: Sequence[str] | None = None,
    incident: int | None = None,
    since: str | None = None,
    until: str | None = None,
    limit: int | None = None,
    newest: bool = False,
) -> Iterator[dict[str, Any]]:
    """Events oldest first (``newest``: the last ``limit`` ones, still printed oldest first).
    ``since``/``until`` are RFC 3339 UTC strings compared with the event's time (else the time
    it was read)."""
    where: list[str] = []
    params: list[Any] = []
    if kind:
        where.append("e.kind = ?")
        params.append(kind)
    if run:
        runs = [run, *(runs or [])]
    if runs is not None:
        where.append("e.run_id IN (SELECT id FROM runs WHERE " + _in("name", runs) + ")")
        params.extend(runs)
    if since:
        where.append("coalesce(e.time, e.ingested_at) >= ?")
        params.append(since)
    if until:
        where.append("coalesce(e.time, e.ingested_at) <= ?")
        params.append(until)
    if incident is not None:
        where.append("e.incident_id = ?")
        params.append(incident)
    sql = _EVENT_SELECT + (" WHERE " + " AND ".join(where) if where else "")
    if newest and limit is not None:
        sql = f"SELECT * FROM ({sql} ORDER BY e.id DESC LIMIT {int(limit)}) ORDER BY 1"
    else:
        sql += " ORDER BY e.id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
    for row in conn.execute(sql, params):
        yield _event(row)


_INCIDENT_SELECT = (
    "SELECT i.id, i.kind, i.title, i.status, r.name, r.experiment, i.ranks, i.first_time, "
    "i.last_time, i.event_count, i.origin, i.hints, i.severity, i.detail, i.created_at, "
    "i.updated_at, i.resolved_at, i.version, r.node, r.job, r.cluster_run, "
    "i.acked_by, i.acked_at, i.ack_note, i.resolved_by, i.resolve_note "
    "FROM incidents i LEFT JOIN runs r ON r.id = i.run_id"
)


def _incident(row: tuple[Any, ...]) -> dict[str, Any]:
    (
        iid,
        kind,
        title,
        status,
        run,
        experiment,
        ranks,
        first,
        last,
        count,
        origin,
        hints,
        severity,
        detail,
        created,
        updated,
        resolved,
        version,
        node,
        job,
        cluster_run,
        acked_by,
        acked_at,
        ack_note,
        resolved_by,
        resolve_note,
    ) = row
    info = json.loads(detail or "{}")
    # where its events were read: one node, or several in a merged database
    nodes = info.get("nodes") or ([node] if node else [])
    return {
        "id": iid,
        "kind": kind,
        "title": title,
        "status": status,
        "run": run,
        "experiment": experiment,
        "ranks": json.loads(ranks or "[]"),
        "first_time": first,
        "last_time": last,
        "event_count": count,
        "origin": json.loads(origin or "{}"),
        "hints": json.loads(hints or "[]"),
        "severity": severity,
        "detail": info,
        "created_at": created,
        "updated_at": updated,
        "resolved_at": resolved,
        "version": version,
        "node": node,
        "job": job,
        "cluster_run": cluster_run,
        "nodes": sorted(str(n) for n in nodes),
        # people's part: `nanwatch ack` / `nanwatch resolve` (None until someone does)
        "acked_by": acked_by,
        "acked_at": acked_at,
        "ack_note": ack_note,
        "resolved_by": resolved_by,
        "resolve_note": resolve_note,
        # why it was resolved: the person's note, or what nanwatch saw
        "resolution": resolve_note if resolved_by else info.get("resolution"),
    }


def list_incidents(
    conn: sqlite3.Connection,
    *,
    open_only: bool = False,
    run: str | None = None,
    runs: Sequence[str] | None = None,
    kind: str | None = None,
    since: str | None = None,
    until: str | None = None,
    limit: int | None = None,
    include_merged: bool = False,
) -> list[dict[str, Any]]:
    """Incidents oldest first; those absorbed into another one (``merged``) only on request.
    ``since``/``until`` keep incidents whose span (first to last event) overlaps them;
    ``limit`` keeps the newest ones."""
    where: list[str] = []
    params: list[Any] = []
    if not include_merged:
        where.append("i.status != 'merged'")
    if open_only:
        where.append("i.status = 'open'")
    if run:
        runs = [run, *(runs or [])]
    if runs is not None:
        where.append(_in("r.name", runs))
        params.extend(runs)
    if kind:
        where.append("i.kind = ?")
        params.append(kind)
    if since:
        where.append("coalesce(i.last_time, i.first_time, i.created_at) >= ?")
        params.append(since)
    if until:
        where.append("coalesce(i.first_time, i.created_at) <= ?")
        params.append(until)
    sql = _INCIDENT_SELECT + (" WHERE " + " AND ".join(where) if where else "")
    if limit is not None:
        sql = f"{sql} ORDER BY i.id DESC LIMIT {int(limit)}"
        return [_incident(r) for r in conn.execute(sql, params)][::-1]
    return [_incident(r) for r in conn.execute(sql + " ORDER BY i.id", params)]


def incident_dict(conn: sqlite3.Connection, incident_id: int) -> dict[str, Any] | None:
    row = conn.execute(_INCIDENT_SELECT + " WHERE i.id = ?", (incident_id,)).fetchone()
    return _incident(row) if row else None


def show_incident(
    conn: sqlite3.Connection, incident_id: int, *, max_events: int | None = None
) -> dict[str, Any] | None:
    """An incident with its events (oldest first) and per-rank timeline."""
    inc = incident_dict(conn, incident_id)
    if inc is None:
        return None
    inc["events"] = list(iter_events(conn, incident=incident_id, limit=max_events))
    timeline = conn.execute(
        "SELECT rank, kind, count(*), min(time), max(time), min(step), max(step), min(id), node "
        "FROM events WHERE incident_id = ? GROUP BY rank, kind, node ORDER BY min(id)",
        (incident_id,),
    ).fetchall()
    inc["timeline"] = [
        {
            "rank": r,
            "kind": k,
            "count": c,
            "first_time": t0,
            "last_time": t1,
            "first_step": s0,
            "last_step": s1,
            "node": node,
        }
        for r, k, c, t0, t1, s0, s1, _, node in timeline
    ]
    return inc


def list_runs(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT r.id, r.name, r.root, r.launch, r.experiment, r.job, r.cluster_run, r.node, "
        "r.created_at, "
        "r.facts, (SELECT count(*) FROM sources s WHERE s.run_id = r.id), "
        "(SELECT count(*) FROM events e WHERE e.run_id = r.id), "
        "(SELECT count(*) FROM incidents i WHERE i.run_id = r.id), "
        "min((SELECT min(time) FROM events e WHERE e.run_id = r.id), "
        "coalesce((SELECT min(time_min) FROM metric_blocks m WHERE m.run_id = r.id), '9')), "
        "max((SELECT max(time) FROM events e WHERE e.run_id = r.id), "
        "coalesce((SELECT max(time_max) FROM metric_blocks m WHERE m.run_id = r.id), '')), "
        "(SELECT group_concat(DISTINCT nullif(s.node, '')) FROM sources s WHERE s.run_id = r.id), "
        "r.first_time, r.last_time, "
        "(SELECT count(*) FROM incidents i WHERE i.run_id = r.id AND i.status = 'open') "
        "FROM runs r ORDER BY r.id"
    ).fetchall()
    out = []
    for (
        rid,
        name,
        root,
        launch,
        exp,
        job,
        cluster_run,
        node,
        created,
        facts,
        nsrc,
        nev,
        ninc,
        first_event,
        last_metric,
        nodes,
        first_time,
        last_time,
        open_incidents,
    ) in rows:
        out.append(
            {
                "id": rid,
                "name": name,
                "path": root,
                "launch": launch or None,
                "experiment": exp,
                "job": job,
                "cluster_run": cluster_run,
                "node": node,
                # every node whose files fed the run (merged databases); else the run's node
                "nodes": sorted(str(nodes).split(",")) if nodes else ([node] if node else []),
                "created_at": created,
                "sources": nsrc,
                "events": nev,
                "incidents": ninc,
                "facts": json.loads(facts or "{}"),
                # databases written before runs kept their span: what their rows say
                "first_time": first_time or first_event,
                "last_time": last_time or last_metric,
                "open_incidents": open_incidents,
                "status": "failing" if open_incidents else "resolved" if ninc else "ok",
            }
        )
    return out
