"""Silences: hold notifications of a run and/or kind until a time (``nanwatch silence``).

A silenced incident's messages are not dropped: the outbox holds them until the silence ends,
then delivers the incident's state at that time (or nothing, if it was resolved meanwhile and
never announced).
"""

from __future__ import annotations

import time

from ..events import format_utc
from ..store.db import Store
from ..store.outbox import OutboxStore
from ..store.records import JSON, Silence


def add_silence(
    store: Store,
    *,
    run: str | None,
    kind: str | None,
    seconds: float,
    comment: str | None = None,
    now: float | None = None,
) -> dict[str, JSON]:
    now = time.time() if now is None else now
    s = OutboxStore(store).add_silence(
        run=run, kind=kind, until=now + seconds, created_at=format_utc(now), comment=comment
    )
    return silence_dict(s, now)


def silence_dict(s: Silence, now: float) -> dict[str, JSON]:
    """A silence as ``nanwatch silences --json`` prints it (``active`` at ``now``)."""
    return {
        "id": s.id,
        "run": s.run,
        "kind": s.kind,
        "until": s.until,
        "until_utc": format_utc(s.until),
        "created_at": s.created_at,
        "comment": s.comment,
        "active": s.until > now,
    }


def list_silences(
    store: Store, *, include_expired: bool = False, now: float | None = None
) -> list[dict[str, JSON]]:
    now = time.time() if now is None else now
    found = OutboxStore(store).silences(active_at=None if include_expired else now)
    return [silence_dict(s, now) for s in found]
