"""People's part of an incident's life: acknowledge it, resolve it (`nanwatch ack`,
`nanwatch resolve`).

Either is one transaction that records who, when and a note with the incident, bumps its
version and queues an outbox row for every sink that already heard of it, so the Slack parent
is re-rendered (and Alertmanager told it resolved) by whichever `watch` delivers the outbox,
like any other change.
"""

from __future__ import annotations

import getpass
import json
import os
import time

from ..errors import NanwatchError
from ..events import now_utc
from ..store import Store


def who() -> str:
    """The person behind the command: the one who ran sudo, else the login name."""
    for var in ("SUDO_USER", "USER"):
        name = os.environ.get(var)
        if name:
            return name
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return os.environ.get("USER") or "unknown"


def acknowledge(store: Store, incident_id: int, *, by: str, note: str | None) -> str:
    """Mark an open incident acknowledged; returns what changed, for the message."""
    when = now_utc()
    with store.transaction():
        status, version = _current(store, incident_id)
        if status != "open":
            raise NanwatchError(
                f"incident #{incident_id} is {status}: nothing to acknowledge "
                "(see `nanwatch show " + str(incident_id) + "`)"
            )
        store.execute(
            "UPDATE incidents SET acked_by = ?, acked_at = ?, ack_note = ?, version = ?, "
            "updated_at = ? WHERE id = ?",
            (by, when, note, version + 1, when, incident_id),
        )
        news = f"Acknowledged by {by} at {when}" + (f": {note}" if note else "")
        _enqueue(store, incident_id, "update", version + 1, news)
    return news


def resolve(store: Store, incident_id: int, *, by: str, note: str | None) -> str:
    """Resolve an incident by hand; returns what changed."""
    when = now_utc()
    with store.transaction():
        status, version = _current(store, incident_id)
        if status != "open":
            raise NanwatchError(f"incident #{incident_id} is already {status}")
        store.execute(
            "UPDATE incidents SET status = 'resolved', resolved_at = ?, resolved_by = ?, "
            "resolve_note = ?, version = ?, updated_at = ? WHERE id = ?",
            (when, by, note, version + 1, when, incident_id),
        )
        news = f"Resolved by {by} at {when}" + (f": {note}" if note else "")
        _enqueue(store, incident_id, "resolve", version + 1, news)
    return news


def _current(store: Store, incident_id: int) -> tuple[str, int]:
    row = store.conn.execute(
        "SELECT status, version FROM incidents WHERE id = ?", (incident_id,)
    ).fetchone()
    if row is None:
        raise NanwatchError(f"no incident #{incident_id}; list them with `nanwatch incidents`")
    return str(row[0]), int(row[1])


def _enqueue(store: Store, incident_id: int, action: str, version: int, news: str) -> None:
    """An outbox row for each sink that has a message or a row for this incident already: a
    sink that never announced it has nothing to update."""
    sinks = [
        s
        for (s,) in store.conn.execute(
            "SELECT sink FROM messages WHERE incident_id = ? UNION "
            "SELECT sink FROM outbox WHERE incident_id = ? ORDER BY 1",
            (incident_id, incident_id),
        )
    ]
    now, due = now_utc(), time.time()
    for sink in sinks:
        store.execute(
            "INSERT OR IGNORE INTO outbox(incident_id, sink, action, payload, dedup_key, "
            "created_at, due_at) VALUES (?,?,?,?,?,?,?)",
            (
                incident_id,
                sink,
                action,
                # immediate: a person's word skips group_interval
                json.dumps({"version": version, "news": [news], "immediate": True}),
                f"{sink}:{incident_id}:{action}:{version}",
                now,
                due,
            ),
        )
