"""The notification tables behind one typed API (nanwatch/store/outbox.py).

Real SQLite: a scanned training run gives real incidents; the outbox rows, messages and
silences are written and read back through ``OutboxStore`` only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import nanwatch
from nanwatch.cli import cli
from nanwatch.demo.simulate import TrainingRun
from nanwatch.notify.view import load_incident
from nanwatch.query import incident_dict, list_incidents
from nanwatch.store import Store
from nanwatch.store.outbox import OutboxStore
from nanwatch.store.records import MessageRef, Outcome, Queued

PACKAGE = Path(nanwatch.__file__).parent
# the notify stage and its commands; the plot's metric rows are read by plot_rows.metrics_for,
# which takes a connection
NOTIFY = [
    p
    for p in [
        *(PACKAGE / "notify").glob("*.py"),
        PACKAGE / "cli/notify.py",
        PACKAGE / "cli/triage.py",
    ]
    if p.name not in ("plot.py", "plot_rows.py")
]
SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE)\b|import sqlite3")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    db = tmp_path / "nw.db"
    wd = tmp_path / "work_dirs" / "dino"
    TrainingRun(wd, timestamp="20261130_101500", ranks=2, nan_rank=1).write()
    TrainingRun(wd, timestamp="20261201_090000", ranks=2, nan_rank=0).write()
    assert CliRunner().invoke(cli, ["scan", "--db", str(db), str(wd)]).exit_code == 0
    return Store.open(db)


def test_the_notify_stage_has_no_sql_of_its_own() -> None:
    offenders = {
        f"{p.relative_to(PACKAGE)}:{n}": line.strip()
        for p in NOTIFY
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if SQL.search(line) or re.search(r"\._?conn\b", line)
    }
    assert offenders == {}


def test_an_incident_reads_as_the_cli_shows_it(store: Store) -> None:
    ids = [i["id"] for i in list_incidents(store._conn, include_merged=True)]
    assert len(ids) >= 2
    for iid in ids:
        view = load_incident(OutboxStore(store), iid)
        want = incident_dict(store._conn, iid)
        assert view == want
        assert list(view or {}) == list(want or {})  # the JSON keeps its key order
    assert load_incident(OutboxStore(store), 999) is None
    store.close()


def test_outcomes_are_recorded_as_decided(store: Store) -> None:
    db = OutboxStore(store)
    now = 1_800_000_000.0
    rows = [Queued(1, "slack", a, {"news": [a]}, f"slack:1:{a}", now) for a in ("open", "update")]
    assert db.enqueue(rows, created_at="2027-01-15T08:00:00.000Z") == 2
    assert db.enqueue(rows[:1], created_at="2027-01-15T08:00:01.000Z") == 0  # same dedup key
    assert db.due(now - 1) == []
    opened, updated = db.due(now)
    assert (opened.action, opened.payload, opened.attempts) == ("open", {"news": ["open"]}, 0)
    assert [r.id for r in db.undelivered(1, "slack", besides=opened.id)] == [updated.id]

    db.record(
        [
            Outcome(opened.id, True, message=MessageRef("C1", "17.5"), then=("details",)),
            Outcome(updated.id, False, "HTTP 503", now + 8),
        ],
        now=now,
        now_text="2027-01-15T08:00:00.000Z",
    )
    message = db.message(1, "slack")
    assert message is not None and (message.channel, message.ts) == ("C1", "17.5")
    assert message.updated_at == "2027-01-15T08:00:00.000Z"
    assert db.waiting(1, "slack", "details") and not db.waiting(1, "slack", "open")
    failed, details = db.undelivered(1, "slack", besides=opened.id)
    assert (failed.attempts, failed.last_error, failed.due_at) == (1, "HTTP 503", now + 8)
    assert (details.action, details.dedup_key, details.due_at) == (
        "details",
        "slack:1:details",
        now,
    )
    assert db.pending() == 2  # the retry and the follow-up

    db.record([Outcome(failed.id, False, "refused", permanent=True)], now=now, now_text="T")
    db.record(
        [Outcome(details.id, False, "silenced until x", now + 60, deferred=True)],
        now=now,
        now_text="T",
    )
    assert db.pending() == 1 and db.pending(include_silenced=False) == 0
    # an edit keeps what it did not say (a webhook has no ts)
    db.record([Outcome(opened.id, True, message=MessageRef("webhook"))], now=now, now_text="U")
    message = db.message(1, "slack")
    assert message is not None and (message.channel, message.ts) == ("webhook", "17.5")
    store.close()


def test_silences_and_reminders_read_at_the_given_time(store: Store) -> None:
    db = OutboxStore(store)
    s = db.add_silence(run=None, kind="nan", until=100.0, created_at="c", comment=None)
    assert db.silence_for("any", "nan", now=99.0) == s
    assert db.silence_for("any", "nan", now=100.0) is None
    assert db.silence_for("any", "oom", now=0.0) is None
    assert db.silences(active_at=101.0) == [] and db.silences() == [s]

    db.record([], now=0.0, now_text="")
    assert db.enqueue([Queued(1, "am", "open", {}, "am:1:open", 0.0)], created_at="c") == 1
    (row,) = db.due(0.0)
    db.record(
        [Outcome(row.id, True, message=MessageRef("am", "{}"))],
        now=0.0,
        now_text="2027-01-01T00:00:00.000Z",
    )
    assert db.quiet_messages("am", "2027-01-01T00:00:00.000Z") == []
    (quiet,) = db.quiet_messages("am", "2027-01-01T00:00:00.001Z")
    assert quiet.incident_id == 1 and db.sinks_told(1) == ["am"]
    store.close()
