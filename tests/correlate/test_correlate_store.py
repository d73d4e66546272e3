"""The correlate stage reaches the store only through its typed API (``store.events``,
``store.incidents``), and returns what it decided for the store to write."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

import nanwatch
from nanwatch.config import Config
from nanwatch.correlate.origin import origin_for
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.events import Event
from nanwatch.store import Store
from nanwatch.store.events import Events
from nanwatch.store.incidents import Incidents, IncidentUpdate, NewIncident, StatusChange
from nanwatch.store.records import Incident, StoredEvent

CORRELATE = Path(nanwatch.__file__).parent / "correlate"
FIXTURES = Path(__file__).parent.parent / "fixtures"
_SQL = re.compile(
    r"""["'](?:SELECT|INSERT|UPDATE|DELETE|WITH)\s|\b(?:FROM|JOIN|INTO)\s+"""
    r"""(?:events|incidents|runs|metrics|sources|meta)\b"""
)


def _stored(store: Store, run: int, *events: Event) -> list[StoredEvent]:
    with store.transaction():
        store.insert_events(run, 1, events, "2026-12-01T10:00:00.000Z")
    return Events(store).after(0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "t.db")
    yield s
    s.close()


def test_correlate_holds_no_sql_and_no_connection() -> None:
    files = sorted(f for f in CORRELATE.glob("*.py") if f.name != "slowdown.py")
    assert len(files) > 10
    for f in files:
        text = f.read_text(encoding="utf-8")
        assert "import sqlite3" not in text, f.name
        assert not _SQL.search(text), f"{f.name}: {_SQL.search(text)}"
        # one hand-over remains: the slowdown module reads step times through a connection
        conns = [ln.strip() for ln in text.splitlines() if "._conn" in ln]
        assert conns == [], f.name


def test_nan_origin_returns_its_story_and_writes_nothing(tmp_path: Path) -> None:
    """The NaN origin's explanation comes back in the Origin record; the incident is written
    once, by the store, from the correlator's update."""
    db = tmp_path / "nan.db"
    writer = Store.open(db)
    try:
        Pipeline(Config(), writer, [str(FIXTURES / "msprobe_4rank_layer_backward" / "run")]).scan()
        (inc,) = [i for i in _all_incidents(writer) if i.kind == "nan"]
        assert inc.detail["root_cause"]
        # a read-only store: any write behind the correlator's back fails here
        reader = Store.open(db, readonly=True)
        try:
            found = origin_for("nan")(Events(reader), inc)
        finally:
            reader.close()
    finally:
        writer.close()
    assert found.event is not None and found.event.id == inc.root_event_id
    assert found.block["tensor"] == inc.origin["tensor"]
    for key in ("root_cause", "notes", "followed"):
        assert found.explains[key] == inc.detail[key], key


def _all_incidents(store: Store) -> list[Incident]:
    repo = Incidents(store)
    top = repo.newest_id() or 0
    return [i for i in (repo.get(n) for n in range(1, top + 1)) if i is not None]


def test_incident_decisions_round_trip(store: Store) -> None:
    run = store.run_id("/data/run", "", "run")
    ev = _stored(store, run, Event("oom", "NPU out of memory", 10, rank=3, step=7))[0]
    repo = Incidents(store)
    with store.transaction():
        made = repo.create(NewIncident(run, "oom", "oom", ev.message, ev.time, {"rank": 3}, ev.id))
        assert (made.status, made.version, made.event_count) == ("open", 0, 0)
        assert made.origin == {"rank": 3} and made.ranks == () and made.detail == {}
        repo.update(
            IncidentUpdate(
                id=made.id,
                ranks=(3, 5),
                first_time="2026-12-01T09:00:00.000Z",
                last_time="2026-12-01T09:05:00.000Z",
                event_count=4,
                origin={"rank": 3, "step": 7},
                title="Out of memory on rank 3",
                root_event_id=ev.id,
                detail={"root_cause": "Rank 3 ran out of device memory.", "nodes": []},
                hints=({"id": "h", "title": "t", "text": "x", "commands": []},),
                version=1,
            )
        )
    got = repo.get(made.id)
    assert got is not None
    assert got.ranks == (3, 5) and got.event_count == 4 and got.version == 1
    assert got.title == "Out of memory on rank 3" and got.origin == {"rank": 3, "step": 7}
    assert got.detail["root_cause"] == "Rank 3 ran out of device memory."
    assert got.hints[0]["id"] == "h"
    assert repo.open_by_key(run, "oom") == got
    assert [r.id for r in repo.open_of_kinds(run, ("oom",))] == [made.id]
    run_rec = repo.run(run)
    assert run_rec is not None and run_rec.name == "run" and run_rec.facts == {}
    with store.transaction():
        repo.close(StatusChange(made.id, "resolved", 2, {**got.detail, "resolution": "quiet"}))
    done = repo.get(made.id)
    assert done is not None and (done.status, done.version) == ("resolved", 2)
    assert done.resolved_at and done.detail["resolution"] == "quiet"
    assert repo.open_by_key(run, "oom") is None


def test_events_by_incident_in_order(store: Store) -> None:
    run = store.run_id("/data/run", "", "run")
    evs = _stored(
        store,
        run,
        Event("nan", "loss is nan", 0, rank=1, step=9, time="2026-12-01T10:00:02.000Z"),
        Event("nan", "loss is nan", 100, rank=0, step=9, time="2026-12-01T10:00:01.000Z"),
        Event("comm_timeout", "HCCL timeout", 200, rank=2, node="n1", fields={"remote_rank": 0}),
    )
    assert [type(e) for e in evs] == [StoredEvent] * 3
    events = Events(store)
    with store.transaction():
        events.assign(1, [e.id for e in evs])
    first = events.earliest(1)
    assert first is not None and first.rank == 0  # the same step: the earlier time
    assert [e.kind for e in events.of_incident(1, kind="comm_timeout")] == ["comm_timeout"]
    assert events.named_peers(1) == [(0, 2)]
    span = events.span(1)
    assert (span.count, span.ranks, span.nodes) == (3, frozenset({0, 1, 2}), frozenset({"n1"}))
    with store.transaction():
        events.move(1, 2)
    assert events.of_incident(1) == [] and len(events.of_incident(2)) == 3
    assert all(e.incident_id == 2 for e in events.after(0))


def test_reader_refuses_writes(tmp_path: Path) -> None:
    """What the NaN test relies on: a read-only store rejects a write."""
    db = tmp_path / "r.db"
    writer = Store.open(db)
    try:
        reader = Store.open(db, readonly=True)
        try:
            with pytest.raises(sqlite3.Error):
                reader._conn.execute("UPDATE incidents SET detail = '{}'")
        finally:
            reader.close()
    finally:
        writer.close()
