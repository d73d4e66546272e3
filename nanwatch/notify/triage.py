"""People's part of an incident's life: acknowledge it, resolve it (`nanwatch ack`,
`nanwatch resolve`).

Either is one transaction that records who, when and a note with the incident, bumps its
version and queues an outbox row for every sink that already heard of it, so the Slack parent
is re-rendered (and Alertmanager told it resolved) by whichever `watch` delivers the outbox,
like any other change.
"""

from __future__ import annotations

import getpass
import os
import time

from ..errors import NanwatchError
from ..events import format_utc
from ..store import Store
from ..store.outbox import OutboxStore
from ..store.records import Queued


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


def acknowledge(
    store: Store, incident_id: int, *, by: str, note: str | None, now: float | None = None
) -> str:
    """Mark an open incident acknowledged; returns what changed, for the message."""
    now = time.time() if now is None else now
    when = format_utc(now)
    db = OutboxStore(store)
    with store.transaction():
        status, version = _current(db, incident_id)
        if status != "open":
            raise NanwatchError(
                f"incident #{incident_id} is {status}: nothing to acknowledge "
                "(see `nanwatch show " + str(incident_id) + "`)"
            )
        db.acknowledge(incident_id, by=by, note=note, when=when, version=version + 1)
        news = f"Acknowledged by {by} at {when}" + (f": {note}" if note else "")
        _enqueue(db, incident_id, "update", version + 1, news, now)
    return news


def resolve(
    store: Store, incident_id: int, *, by: str, note: str | None, now: float | None = None
) -> str:
    """Resolve an incident by hand; returns what changed."""
    now = time.time() if now is None else now
    when = format_utc(now)
    db = OutboxStore(store)
    with store.transaction():
        status, version = _current(db, incident_id)
        if status != "open":
            raise NanwatchError(f"incident #{incident_id} is already {status}")
        db.resolve(incident_id, by=by, note=note, when=when, version=version + 1)
        news = f"Resolved by {by} at {when}" + (f": {note}" if note else "")
        _enqueue(db, incident_id, "resolve", version + 1, news, now)
    return news


def _current(db: OutboxStore, incident_id: int) -> tuple[str, int]:
    got = db.status_version(incident_id)
    if got is None:
        raise NanwatchError(f"no incident #{incident_id}; list them with `nanwatch incidents`")
    return got


def _enqueue(
    db: OutboxStore, incident_id: int, action: str, version: int, news: str, now: float
) -> None:
    """An outbox row for each sink that has a message or a row for this incident already: a
    sink that never announced it has nothing to update."""
    db.enqueue(
        [
            Queued(
                incident_id,
                sink,
                action,
                # immediate: a person's word skips group_interval
                {"version": version, "news": [news], "immediate": True},
                f"{sink}:{incident_id}:{action}:{version}",
                now,
            )
            for sink in db.sinks_told(incident_id)
        ],
        created_at=format_utc(now),
    )
