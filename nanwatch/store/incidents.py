"""Incidents as correlation reads and writes them.

Readers return ``Incident`` records. The correlator decides and this module writes: a new
incident (``NewIncident``), what a pass learned about one (``IncidentUpdate``: its span, origin,
title, detail and hints, written together in one statement), and the end of one
(``StatusChange``: resolved, or merged into another). No other code writes these columns, so
nothing re-reads a column another stage wrote behind its back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import field

from .._dc import dataclass
from ..events import now_utc
from .db import Store
from .records import INCIDENT_COLUMNS, JSON, RUN_COLUMNS, Incident, Run, columns

__all__ = [
    "INCIDENT_COLUMNS",
    "IncidentUpdate",
    "Incidents",
    "NewIncident",
    "StatusChange",
]


@dataclass(frozen=True, slots=True)
class NewIncident:
    """An incident opened at one event: its run, grouping key and first event."""

    run_id: int | None
    kind: str
    key: str
    title: str
    time: str | None
    origin: Mapping[str, JSON]
    root_event_id: int


@dataclass(frozen=True, slots=True)
class IncidentUpdate:
    """What one correlation pass decided about an open incident (every column it owns)."""

    id: int
    ranks: tuple[int, ...]
    first_time: str | None
    last_time: str | None
    event_count: int
    origin: Mapping[str, JSON]
    title: str
    root_event_id: int | None
    detail: Mapping[str, JSON]
    hints: tuple[JSON, ...]
    version: int


@dataclass(frozen=True, slots=True)
class StatusChange:
    """An incident ends: ``resolved`` (the run recovered, went quiet...) or ``merged`` into
    another one; ``detail`` says why."""

    id: int
    status: str
    version: int
    detail: Mapping[str, JSON] = field(default_factory=dict)


def _dumps(value: object) -> str:
    return json.dumps(value)


class Incidents:
    """The ``incidents`` table for the correlate stage (in the writer's transaction)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _select(self, where: str, params: Sequence[object] = ()) -> list[Incident]:
        sql = f"SELECT {INCIDENT_COLUMNS} FROM incidents WHERE {where}"
        return [Incident.from_row(r) for r in self._store._conn.execute(sql, params).fetchall()]

    # -- reads -----------------------------------------------------------------------------------

    def get(self, incident_id: int) -> Incident | None:
        found = self._select("id = ?", (incident_id,))
        return found[0] if found else None

    def open_by_key(self, run_id: int | None, key: str) -> Incident | None:
        """The run's newest open incident with this grouping key."""
        found = self._select(
            "run_id IS ? AND key=? AND status='open' ORDER BY id DESC LIMIT 1", (run_id, key)
        )
        return found[0] if found else None

    def open_comm_ids(self, run_id: int | None) -> list[int]:
        """The run's open communication incidents (any backend)."""
        rows = self._store._conn.execute(
            "SELECT id FROM incidents WHERE run_id IS ? AND key LIKE 'comm:%' AND status = 'open'",
            (run_id,),
        )
        return [int(r[0]) for r in rows]

    def open_of_kinds(self, run_id: int | None, kinds: Sequence[str]) -> list[Incident]:
        """The run's open incidents of these kinds, oldest first."""
        marks = ", ".join("?" * len(kinds))
        return self._select(
            f"run_id IS ? AND status = 'open' AND kind IN ({marks}) ORDER BY id", (run_id, *kinds)
        )

    def open_nan_last_steps(self) -> list[tuple[Incident, int | None]]:
        """Open NaN incidents with the highest step among their events."""
        cols = columns(INCIDENT_COLUMNS, "i")
        rows = self._store._conn.execute(
            f"SELECT {cols}, (SELECT max(step) FROM events e WHERE e.incident_id = i.id) "
            "FROM incidents i WHERE i.status = 'open' AND i.kind = 'nan'"
        ).fetchall()
        return [(Incident.from_row(r[:-1]), r[-1]) for r in rows]

    def open_in_experiments(self) -> list[tuple[Incident, str]]:
        """Open incidents of runs that belong to an experiment, with its name."""
        cols = columns(INCIDENT_COLUMNS, "i")
        rows = self._store._conn.execute(
            f"SELECT {cols}, r.experiment FROM incidents i JOIN runs r ON r.id = i.run_id "
            "WHERE i.status = 'open' AND r.experiment IS NOT NULL"
        ).fetchall()
        return [(Incident.from_row(r[:-1]), str(r[-1])) for r in rows]

    def open_updated_before(self, cutoff: str) -> list[Incident]:
        return self._select("status = 'open' AND updated_at < ?", (cutoff,))

    def newest_id(self) -> int | None:
        row = self._store._conn.execute("SELECT max(id) FROM incidents").fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def run(self, run_id: int | None) -> Run | None:
        """The incident's run (its name, experiment, facts, work_dir)."""
        row = self._store._conn.execute(
            f"SELECT {RUN_COLUMNS} FROM runs WHERE id IS ?", (run_id,)
        ).fetchone()
        if row is None:
            return None
        return Run.from_row(row)

    # -- writes ----------------------------------------------------------------------------------

    def create(self, new: NewIncident) -> Incident:
        now = now_utc()
        cur = self._store.execute(
            "INSERT INTO incidents(run_id, kind, key, title, status, ranks, first_time, "
            "last_time, event_count, origin, hints, detail, root_event_id, version, created_at, "
            "updated_at) VALUES (?,?,?,?,'open','[]',?,?,0,?,'[]','{}',?,0,?,?)",
            (
                new.run_id,
                new.kind,
                new.key,
                new.title,
                new.time,
                new.time,
                _dumps(dict(new.origin)),
                new.root_event_id,
                now,
                now,
            ),
        )
        made = self.get(int(cur.lastrowid or 0))
        assert made is not None
        return made

    def update(self, u: IncidentUpdate) -> None:
        self._store.execute(
            "UPDATE incidents SET ranks=?, first_time=?, last_time=?, event_count=?, origin=?, "
            "title=?, root_event_id=?, detail=?, hints=?, version=?, updated_at=? WHERE id=?",
            (
                _dumps(list(u.ranks)),
                u.first_time,
                u.last_time,
                u.event_count,
                _dumps(dict(u.origin)),
                u.title,
                u.root_event_id,
                _dumps(dict(u.detail)),
                _dumps(list(u.hints)),
                u.version,
                now_utc(),
                u.id,
            ),
        )

    def close(self, c: StatusChange) -> None:
        now = now_utc()
        self._store.execute(
            "UPDATE incidents SET status = ?, resolved_at = ?, updated_at = ?, version = ?, "
            "detail = ? WHERE id = ?",
            (c.status, now, now, c.version, _dumps(dict(c.detail)), c.id),
        )

    def delete(self, incident_id: int) -> None:
        """Drop an incident this pass created and then merged away (no one has seen it)."""
        self._store.execute("DELETE FROM incidents WHERE id = ?", (incident_id,))
