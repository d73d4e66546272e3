"""The read side's listings: events and incidents under the CLI's filters, an incident's story.

Readers open their own connection (WAL) and never block the writer. Every filter goes through
one builder (``_Where``), so `events` and `incidents` read --run/--kind/--rank/--since/--until
the same way.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .db import Store
from .records import (
    EVENT_COLUMNS,
    EventRow,
    FileHealth,
    Incident,
    IncidentRow,
    Run,
    StoredEvent,
    TimelineRow,
    columns,
)
from .records import (
    INCIDENT_COLUMNS as INCIDENT_ROW,
)
from .runs import RUN_COLUMNS

_EVENT_SELECT = (
    "SELECT "
    + columns(EVENT_COLUMNS, "e")
    + ", r.name, s.path FROM events e LEFT JOIN runs r ON r.id = e.run_id "
    "LEFT JOIN sources s ON s.id = e.source_id"
)
_NEVENT = len(EVENT_COLUMNS.split(","))

INCIDENT_COLUMNS = columns(INCIDENT_ROW, "i")
_NINCIDENT = len(INCIDENT_COLUMNS.split(","))
_INCIDENT_SELECT = (
    f"SELECT {INCIDENT_COLUMNS}, {RUN_COLUMNS} FROM incidents i LEFT JOIN runs r ON r.id = i.run_id"
)


def _incident_row(row: Sequence[Any]) -> IncidentRow:
    run = row[_NINCIDENT:]
    return IncidentRow(
        incident=Incident.from_row(row[:_NINCIDENT]),
        run=Run.from_row(run) if run[0] is not None else None,
    )


def _event_row(row: Sequence[Any]) -> EventRow:
    return EventRow(
        event=StoredEvent.from_row(row[:_NEVENT]), run=row[_NEVENT], file=row[_NEVENT + 1]
    )


def fts_query(text: str) -> str:
    """``--grep`` text as an FTS5 query: its words, in this order, as whole words (a word
    ending in ``*`` is a prefix). Quoting each word keeps FTS5's operators (AND, NEAR, -,
    column:) out of what people type: ``rank=3`` is the words rank and 3, never a column."""
    parts = []
    for word in text.split():
        prefix = word.endswith("*") and len(word) > 1
        word = word.rstrip("*") if prefix else word
        parts.append('"' + word.replace('"', '""') + '"' + (" *" if prefix else ""))
    return " + ".join(parts)


class _Where:
    """One WHERE clause and its parameters, built filter by filter."""

    def __init__(self) -> None:
        self.terms: list[str] = []
        self.params: list[object] = []

    def add(self, term: str, *params: object) -> None:
        self.terms.append(term)
        self.params.extend(params)

    def common(
        self,
        table: str,
        *,
        runs: Sequence[str] | None,
        kind: str | None,
        since: str | None,
        until: str | None,
        first: str,
        last: str,
    ) -> None:
        """The filters events and incidents share. ``since``/``until`` keep rows whose span
        (``first`` to ``last``, SQL expressions) overlaps them."""
        if kind:
            self.add(f"{table}.kind = ?", kind)
        if runs is not None:
            # by id: the (run_id, kind, id) indexes serve it
            names = ",".join("?" * len(runs))
            self.add(f"{table}.run_id IN (SELECT id FROM runs WHERE name IN ({names}))", *runs)
        if since:
            self.add(f"{last} >= ?", since)
        if until:
            self.add(f"{first} <= ?", until)

    def sql(self) -> str:
        return " WHERE " + " AND ".join(self.terms) if self.terms else ""


class Reads:
    """Events, incidents and an incident's story, as the read commands list them."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def events(
        self,
        *,
        kind: str | None = None,
        runs: Sequence[str] | None = None,
        rank: int | None = None,
        incident: int | None = None,
        since: str | None = None,
        until: str | None = None,
        grep: str | None = None,
        limit: int | None = None,
        newest: bool = False,
    ) -> Iterator[EventRow]:
        """Events oldest first (``newest``: the last ``limit`` ones, still oldest first).
        ``since``/``until`` are RFC 3339 UTC strings compared with the event's time (else the
        time it was read); ``grep``: words of its message (full-text search)."""
        w = _Where()
        when = "coalesce(e.time, e.ingested_at)"
        w.common("e", runs=runs, kind=kind, since=since, until=until, first=when, last=when)
        if rank is not None:
            w.add("e.rank = ?", rank)
        if incident is not None:
            w.add("e.incident_id = ?", incident)
        if grep is not None:
            # the index's rowids drive the lookup: no scan of the events table
            match = "e.id IN (SELECT rowid FROM events_fts WHERE events_fts MATCH ?)"
            w.add(match, fts_query(grep))
        sql = _EVENT_SELECT + w.sql()
        if newest and limit is not None:
            sql = f"SELECT * FROM ({sql} ORDER BY e.id DESC LIMIT {int(limit)}) ORDER BY 1"
        else:
            sql += " ORDER BY e.id" + (f" LIMIT {int(limit)}" if limit is not None else "")
        for row in self.store.execute(sql, w.params):
            yield _event_row(row)

    def incidents(
        self,
        *,
        status: str | None = None,
        runs: Sequence[str] | None = None,
        kind: str | None = None,
        rank: int | None = None,
        since: str | None = None,
        until: str | None = None,
        limit: int | None = None,
        include_merged: bool = False,
    ) -> list[IncidentRow]:
        """Incidents oldest first; those absorbed into another one (``merged``) only on
        request. ``since``/``until`` keep incidents whose span (first to last event) overlaps
        them; ``limit`` keeps the newest ones; ``rank``: those the rank took part in."""
        w = _Where()
        if not include_merged:
            w.add("i.status != 'merged'")
        if status is not None:
            w.add("i.status = ?", status)
        w.common(
            "i",
            runs=runs,
            kind=kind,
            since=since,
            until=until,
            first="coalesce(i.first_time, i.created_at)",
            last="coalesce(i.last_time, i.first_time, i.created_at)",
        )
        if rank is not None:
            w.add("EXISTS (SELECT 1 FROM json_each(i.ranks) WHERE value = ?)", rank)
        sql = _INCIDENT_SELECT + w.sql()
        if limit is not None:
            sql = f"{sql} ORDER BY i.id DESC LIMIT {int(limit)}"
            return [_incident_row(r) for r in self.store.execute(sql, w.params)][::-1]
        return [_incident_row(r) for r in self.store.execute(sql + " ORDER BY i.id", w.params)]

    def open_by_kind(self) -> list[tuple[str, int]]:
        """(kind, how many open incidents) for the service's metrics."""
        rows = self.store.execute(
            "SELECT kind, count(*) FROM incidents WHERE status = 'open' GROUP BY kind"
        ).fetchall()
        return [(str(k), int(n)) for k, n in rows]

    def incident(self, incident_id: int) -> IncidentRow | None:
        row = self.store.execute(_INCIDENT_SELECT + " WHERE i.id = ?", (incident_id,)).fetchone()
        return _incident_row(row) if row else None

    def open_count(self) -> int:
        row = self.store.execute("SELECT count(*) FROM incidents WHERE status = 'open'").fetchone()
        return int(row[0])

    def timeline(self, incident_id: int) -> list[TimelineRow]:
        """The incident's events per rank, kind and node, in the order they first appeared."""
        rows = self.store.execute(
            "SELECT rank, kind, count(*), min(time), max(time), min(step), max(step), min(id), "
            "node FROM events WHERE incident_id = ? GROUP BY rank, kind, node ORDER BY min(id)",
            (incident_id,),
        )
        return [
            TimelineRow(
                rank=r,
                kind=str(k),
                count=int(c),
                first_time=t0,
                last_time=t1,
                first_step=s0,
                last_step=s1,
                node=node,
            )
            for r, k, c, t0, t1, s0, s1, _, node in rows
        ]


def file_health(path: Path) -> FileHealth:
    """What the database file at ``path`` says about itself, read-only and without migrating
    it (``doctor`` must look at a file as it is); ``check`` holds the error when it cannot."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:

            def one(pragma: str) -> Any:
                return conn.execute(f"PRAGMA {pragma}").fetchone()[0]

            return FileHealth(
                check=str(one("quick_check")),
                journal=str(one("journal_mode")),
                auto_vacuum=int(one("auto_vacuum")),
                version=int(one("user_version")),
                page_size=int(one("page_size")),
                pages=int(one("page_count")),
                free=int(one("freelist_count")),
            )
        finally:
            conn.close()
    except sqlite3.Error as e:
        return FileHealth(str(e), "", 0, 0, 0, 0, 0)


Readable = Store | sqlite3.Connection


def as_store(source: Readable) -> Store:
    """A Store over ``source``. A bare connection is what callers written before the typed
    API hold (the notifiers' own reader, scripts): wrapped, never closed here."""
    if isinstance(source, Store):
        return source
    return Store(Store.last_opened or Path("?"), source, readonly=True)
