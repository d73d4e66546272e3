"""The notification tables: the outbox, the messages sinks posted, silences.

``OutboxStore(store)`` is the one way the notify stage reads and writes them: it queues rows
(once per ``dedup_key``), hands out due rows as :class:`OutboxRow` records, records what a
sender decided (:class:`Outcome`: delivered with the message it posted, retried, held, given
up), and keeps silences. Times are passed in by the caller (its clock), never read here.

It also carries the few reads of other tables a sink needs while it delivers (an incident with
its run, where its root event was read, the database's uid): the sender has only its own
read-only connection and must not depend on another stage's module to get them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from .db import Store
from .records import (
    INCIDENT_COLUMNS,
    RUN_COLUMNS,
    EventPlace,
    Incident,
    Message,
    MessageRef,
    OutboxRow,
    Outcome,
    Queued,
    Run,
    Silence,
    loads,
)

__all__ = ["SILENCED", "OutboxStore"]

SILENCED = "silenced"  # prefix of last_error for rows held by a silence

_ROW = (
    "id, incident_id, sink, action, payload, dedup_key, created_at, due_at, attempts, "
    "last_error, delivered_at"
)
_INSERT = (
    "INSERT OR IGNORE INTO outbox(incident_id, sink, action, payload, dedup_key, created_at, "
    "due_at) VALUES (?,?,?,?,?,?,?)"
)
_MESSAGE = "incident_id, sink, channel, ts, thread_ts, posted_at, updated_at"
_SILENCE = "id, run, kind, until, created_at, comment"


def _outbox_row(row: Sequence[Any]) -> OutboxRow:
    rid, iid, sink, action, payload, key, created, due, attempts, error, delivered = row
    return OutboxRow(
        id=int(rid),
        incident_id=iid,
        sink=str(sink),
        action=str(action),
        payload=loads(payload, {}),
        dedup_key=str(key),
        created_at=str(created),
        due_at=float(due),
        attempts=int(attempts),
        last_error=error,
        delivered_at=delivered,
    )


def _message(row: Sequence[Any]) -> Message:
    iid, sink, channel, ts, thread_ts, posted, updated = row
    return Message(int(iid), str(sink), channel, ts, thread_ts, str(posted), updated)


def _silence(row: Sequence[Any]) -> Silence:
    sid, run, kind, until, created, comment = row
    return Silence(int(sid), run, kind, float(until), str(created), comment)


class OutboxStore:
    """The outbox, messages and silences of one store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # -- queueing --------------------------------------------------------------------------------

    def enqueue(self, rows: Iterable[Queued], *, created_at: str) -> int:
        """Queue rows in one transaction; returns how many were new (not seen dedup keys)."""
        values = [
            (
                q.incident_id,
                q.sink,
                q.action,
                json.dumps(dict(q.payload)),
                q.dedup_key,
                created_at,
                q.due_at,
            )
            for q in rows
        ]
        if not values:
            return 0
        conn = self.store._conn
        before = conn.total_changes
        with self.store.transaction():
            conn.executemany(_INSERT, values)
        return conn.total_changes - before

    def quiet_messages(self, sink: str, before: str) -> list[Message]:
        """Messages of open incidents not touched since ``before`` (RFC 3339) and with nothing
        queued for them: what a reminder is for."""
        rows = self.store.execute(
            "SELECT m.incident_id, m.sink, m.channel, m.ts, m.thread_ts, m.posted_at, "
            "m.updated_at FROM messages m JOIN incidents i ON i.id = m.incident_id "
            "WHERE m.sink = ? AND i.status = 'open' "
            "AND coalesce(m.updated_at, m.posted_at) < ? "
            "AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.incident_id = m.incident_id "
            "AND o.sink = m.sink AND o.delivered_at IS NULL)",
            (sink, before),
        ).fetchall()
        return [_message(r) for r in rows]

    def sinks_told(self, incident_id: int) -> list[str]:
        """Sinks with a message or an outbox row for the incident, by name."""
        return [
            str(s)
            for (s,) in self.store.execute(
                "SELECT sink FROM messages WHERE incident_id = ? UNION "
                "SELECT sink FROM outbox WHERE incident_id = ? ORDER BY 1",
                (incident_id, incident_id),
            )
        ]

    # -- delivering (the sender's read-only connection) ------------------------------------------

    def due(self, now: float, *, limit: int = 200) -> list[OutboxRow]:
        """Undelivered rows due at ``now`` (epoch seconds), the oldest due first."""
        rows = self.store.execute(
            f"SELECT {_ROW} FROM outbox WHERE delivered_at IS NULL AND due_at <= ? "
            "ORDER BY due_at, id LIMIT ?",
            (now, int(limit)),
        ).fetchall()
        return [_outbox_row(r) for r in rows]

    def undelivered(self, incident_id: int, sink: str, *, besides: int) -> list[OutboxRow]:
        """The other undelivered rows of an incident for a sink, oldest first."""
        rows = self.store.execute(
            f"SELECT {_ROW} FROM outbox WHERE incident_id=? AND sink=? "
            "AND delivered_at IS NULL AND id != ? ORDER BY id",
            (incident_id, sink, besides),
        ).fetchall()
        return [_outbox_row(r) for r in rows]

    def waiting(self, incident_id: int, sink: str, action: str) -> bool:
        """Whether an undelivered ``action`` row is queued for the incident and sink."""
        row = self.store.execute(
            "SELECT 1 FROM outbox WHERE incident_id=? AND sink=? AND action=? "
            "AND delivered_at IS NULL",
            (incident_id, sink, action),
        ).fetchone()
        return row is not None

    def pending(self, *, include_silenced: bool = True) -> int:
        """Undelivered rows (``include_silenced=False``: not counting those a silence holds)."""
        sql = "SELECT count(*) FROM outbox WHERE delivered_at IS NULL"
        if not include_silenced:
            sql += f" AND coalesce(last_error, '') NOT LIKE '{SILENCED}%'"
        return int(self.store.execute(sql).fetchone()[0])

    def depth_by_sink(self) -> list[tuple[str, int]]:
        """(sink, undelivered rows) for the service's metrics."""
        rows = self.store.execute(
            "SELECT sink, count(*) FROM outbox WHERE delivered_at IS NULL GROUP BY sink"
        ).fetchall()
        return [(str(k), int(n)) for k, n in rows]

    def unsent(self) -> tuple[int, float | None]:
        """Undelivered rows not held by a silence, and when the first of them is due."""
        row = self.store.execute(
            "SELECT count(*), min(due_at) FROM outbox WHERE delivered_at IS NULL "
            f"AND coalesce(last_error, '') NOT LIKE '{SILENCED}%'"
        ).fetchone()
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    def due_count(self, now: float) -> int:
        """Undelivered rows due by ``now`` (silenced ones included)."""
        row = self.store.execute(
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND due_at <= ?", (now,)
        ).fetchone()
        return int(row[0])

    def release(self, incident_ids: Iterable[int], *, now: float) -> int:
        """Make the undelivered ``open`` rows of these incidents due now (a held symptom that
        became a root, or absorbed one, needs no more waiting)."""
        ids = sorted(set(incident_ids))
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        with self.store.transaction():
            cur = self.store.execute(
                f"UPDATE outbox SET due_at = ? WHERE delivered_at IS NULL AND action = 'open' "
                f"AND due_at > ? AND incident_id IN ({marks})",
                (now, now, *ids),
            )
        return int(cur.rowcount or 0)

    # -- recording what the sender decided (writer) ----------------------------------------------

    def record(self, outcomes: Iterable[Outcome], *, now: float, now_text: str) -> None:
        """Write outcomes in one transaction. ``now`` (epoch seconds) and ``now_text`` (the
        same instant, RFC 3339) stamp deliveries and default a retry to five seconds on."""
        outcomes = list(outcomes)
        if not outcomes:
            return
        with self.store.transaction():
            for r in outcomes:
                if r.ok:
                    self.store.execute(
                        "UPDATE outbox SET delivered_at=?, attempts=attempts+1, last_error=NULL "
                        "WHERE id=?",
                        (now_text, r.row_id),
                    )
                    if r.message is not None:
                        self._remember(r.row_id, r.message, now_text)
                    if r.then:
                        self._follow_up(r.row_id, r.then, now=now, now_text=now_text)
                elif r.deferred:
                    self.store.execute(
                        "UPDATE outbox SET last_error=?, due_at=? WHERE id=?",
                        (r.error, r.retry_at or now + 5, r.row_id),
                    )
                elif r.permanent:
                    self.store.execute(
                        "UPDATE outbox SET delivered_at=?, attempts=attempts+1, last_error=? "
                        "WHERE id=?",
                        ("failed " + now_text, r.error, r.row_id),
                    )
                else:
                    self.store.execute(
                        "UPDATE outbox SET attempts=attempts+1, last_error=?, due_at=? WHERE id=?",
                        (r.error, r.retry_at or now + 5, r.row_id),
                    )

    def _owner(self, row_id: int) -> tuple[int | None, str] | None:
        row = self.store.execute(
            "SELECT incident_id, sink FROM outbox WHERE id=?", (row_id,)
        ).fetchone()
        return None if row is None else (row[0], str(row[1]))

    def _remember(self, row_id: int, message: MessageRef, now_text: str) -> None:
        owner = self._owner(row_id)
        if owner is None or owner[0] is None:
            return
        self.store.execute(
            "INSERT INTO messages(incident_id, sink, channel, ts, thread_ts, posted_at, "
            "updated_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT(incident_id, sink) DO UPDATE SET "
            "channel=coalesce(excluded.channel, channel), ts=coalesce(excluded.ts, ts), "
            "thread_ts=coalesce(excluded.thread_ts, thread_ts), updated_at=excluded.updated_at",
            (*owner, message.channel, message.ts, message.thread_ts, now_text, now_text),
        )

    def _follow_up(self, row_id: int, actions: Iterable[str], *, now: float, now_text: str) -> None:
        owner = self._owner(row_id)
        if owner is None:
            return
        iid, sink = owner
        for action in actions:
            self.store.execute(
                _INSERT, (iid, sink, action, "{}", f"{sink}:{iid}:{action}", now_text, now)
            )

    # -- messages --------------------------------------------------------------------------------

    def message(self, incident_id: int, sink: str) -> Message | None:
        """The incident's message in a sink, if it posted one."""
        row = self.store.execute(
            f"SELECT {_MESSAGE} FROM messages WHERE incident_id=? AND sink=?",
            (incident_id, sink),
        ).fetchone()
        return _message(row) if row else None

    def routed_messages(
        self, sink: str, *, limit: int = 100
    ) -> list[tuple[Message, str, str, str | None]]:
        """The newest messages a sink posted to a channel (not a webhook), each with its
        incident's kind, severity and run name: how it was routed."""
        rows = self.store.execute(
            "SELECT m.incident_id, m.sink, m.channel, m.ts, m.thread_ts, m.posted_at, "
            "m.updated_at, i.kind, i.severity, r.name FROM messages m "
            "JOIN incidents i ON i.id = m.incident_id LEFT JOIN runs r ON r.id = i.run_id "
            "WHERE m.sink = ? AND m.channel IS NOT NULL AND m.channel != 'webhook' "
            "ORDER BY m.posted_at DESC LIMIT ?",
            (sink, int(limit)),
        ).fetchall()
        return [(_message(r[:7]), str(r[7]), str(r[8]), r[9]) for r in rows]

    # -- silences --------------------------------------------------------------------------------

    def add_silence(
        self,
        *,
        run: str | None,
        kind: str | None,
        until: float,
        created_at: str,
        comment: str | None,
    ) -> Silence:
        with self.store.transaction():
            cur = self.store.execute(
                "INSERT INTO silences(run, kind, until, created_at, comment) VALUES (?,?,?,?,?)",
                (run, kind, until, created_at, comment),
            )
        return Silence(int(cur.lastrowid or 0), run, kind, until, created_at, comment)

    def silences(self, *, active_at: float | None = None) -> list[Silence]:
        """Every silence (``active_at``: only those lasting past that time), oldest first."""
        sql = f"SELECT {_SILENCE} FROM silences"
        params: tuple[float, ...] = ()
        if active_at is not None:
            sql += " WHERE until > ?"
            params = (active_at,)
        return [_silence(r) for r in self.store.execute(sql + " ORDER BY id", params)]

    def silence_for(self, run: str | None, kind: str | None, *, now: float) -> Silence | None:
        """The longest-lasting silence active at ``now`` matching a run and kind."""
        row = self.store.execute(
            f"SELECT {_SILENCE} FROM silences "
            "WHERE until > ? AND (run IS NULL OR run = ?) AND (kind IS NULL OR kind = ?) "
            "ORDER BY until DESC LIMIT 1",
            (now, run, kind),
        ).fetchone()
        return _silence(row) if row else None

    # -- what a sink reads about an incident -----------------------------------------------------

    def incident(self, incident_id: int) -> tuple[Incident, Run | None] | None:
        """An incident and its run (None: removed by retention meanwhile)."""
        row = self.store.execute(
            f"SELECT {INCIDENT_COLUMNS} FROM incidents WHERE id = ?", (incident_id,)
        ).fetchone()
        if row is None:
            return None
        inc = Incident.from_row(row)
        if inc.run_id is None:
            return inc, None
        run = self.store.execute(
            f"SELECT {RUN_COLUMNS} FROM runs WHERE id = ?", (inc.run_id,)
        ).fetchone()
        return inc, Run.from_row(run) if run else None

    def event_place(self, event_id: int) -> EventPlace | None:
        """The source file, line and offset an event was read from."""
        row = self.store.execute(
            "SELECT s.path, e.line, s.dev, s.ino, e.offset FROM events e "
            "JOIN sources s ON s.id = e.source_id WHERE e.id = ?",
            (event_id,),
        ).fetchone()
        if row is None or not row[0]:
            return None
        return EventPlace(str(row[0]), row[1], int(row[2]), int(row[3]), int(row[4]))

    def uid(self) -> str:
        """This database's uid (tells its messages apart from another database's)."""
        return self.store.meta_get("uid") or ""

    # -- people's word on an incident (`nanwatch ack`, `nanwatch resolve`) -----------------------

    def status_version(self, incident_id: int) -> tuple[str, int] | None:
        row = self.store.execute(
            "SELECT status, version FROM incidents WHERE id = ?", (incident_id,)
        ).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))

    def acknowledge(
        self, incident_id: int, *, by: str, note: str | None, when: str, version: int
    ) -> None:
        self.store.execute(
            "UPDATE incidents SET acked_by = ?, acked_at = ?, ack_note = ?, version = ?, "
            "updated_at = ? WHERE id = ?",
            (by, when, note, version, when, incident_id),
        )

    def resolve(
        self, incident_id: int, *, by: str, note: str | None, when: str, version: int
    ) -> None:
        self.store.execute(
            "UPDATE incidents SET status = 'resolved', resolved_at = ?, resolved_by = ?, "
            "resolve_note = ?, version = ?, updated_at = ? WHERE id = ?",
            (when, by, note, version, when, incident_id),
        )
