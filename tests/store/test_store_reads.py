"""The read side's store API: records under the CLI's filters, full-text search over event
messages (`events --grep`), and the index an older database gets when it is migrated."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.events import Event
from nanwatch.store import SCHEMA_VERSION, Store
from nanwatch.store.reads import Reads, fts_query
from nanwatch.store.records import EventRow, IncidentRow, Run, RunSummary
from nanwatch.store.runs import Runs
from nanwatch.store.schema import MIGRATIONS

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.fixture(scope="module")
def hccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two NPU nodes whose ranks time out on HCCL (EI0002) after rank 5 was killed."""
    tmp = tmp_path_factory.mktemp("reads")
    shutil.copytree(FIXTURES / "npu_rank_killed_hccl" / "logs", tmp / "logs")
    db = tmp / "nw.db"
    r = CliRunner().invoke(cli, ["scan", "--db", str(db), str(tmp / "logs")])
    assert r.exit_code == 0, r.output
    return db


def events(db: Path, *args: str) -> list[dict[str, object]]:
    r = CliRunner().invoke(cli, ["events", "--db", str(db), "--json", *args])
    assert r.exit_code == 0, r.output
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_grep_finds_the_events_whose_message_has_the_words(hccl: Path) -> None:
    every = events(hccl)
    want = [e["id"] for e in every if "EI0002" in str(e["message"])]
    assert want and len(want) < len(every)
    assert [e["id"] for e in events(hccl, "--grep", "EI0002")] == want
    assert [e["id"] for e in events(hccl, "--grep", "ei0002")] == want  # any case
    # words in this order, whole words, punctuation between them as the message has it
    killed = [e for e in every if "was killed" in str(e["message"])]
    assert len(killed) == 1  # the launcher's exit line and its summary are one event
    assert events(hccl, "--grep", "killed") == killed
    assert events(hccl, "--grep", "rank 1 was killed") == killed
    assert events(hccl, "--grep", "rank 2 was killed") == []
    assert events(hccl, "--grep", "killed was") == []
    assert events(hccl, "--grep", "SIGKILL exit code 9") == killed
    assert events(hccl, "--grep", "kill") == []
    assert [e["id"] for e in events(hccl, "--grep", "EI000*")] == want  # a prefix
    # filters combine; FTS5's operators in what people type are words, not syntax
    assert events(hccl, "--grep", "EI0002", "--kind", "oom") == []
    assert events(hccl, "--grep", 'NOT "x" OR message:y') == []
    newest = events(hccl, "--grep", "EI0002", "--limit", "1")
    assert [e["id"] for e in newest] == want[-1:]


def test_grep_without_words_is_a_usage_error(hccl: Path) -> None:
    for nothing in (" * ", "==", ""):
        r = CliRunner().invoke(cli, ["events", "--db", str(hccl), "--grep", nothing])
        assert r.exit_code == 2 and "--grep" in r.output and "word" in r.output
    r = CliRunner().invoke(cli, ["events", "--db", str(hccl), "--grep", "nothing-like-it"])
    assert r.exit_code == 0 and "No events" in r.output and "filters" in r.output


def test_fts_query_quotes_every_word() -> None:
    assert fts_query("EI0002") == '"EI0002"'
    assert fts_query('rank=3 say "hi" ab*') == '"rank=3" + "say" + """hi""" + "ab" *'


def test_index_follows_inserts_deletes_and_tools_find_it(hccl: Path, tmp_path: Path) -> None:
    db = tmp_path / "copy.db"
    shutil.copy(hccl, db)
    store = Store.open(db)
    try:
        reads = Reads(store)
        (first, *_) = [r.event.id for r in reads.events(grep="EI0002")]
        with store.transaction():
            store.execute("DELETE FROM events WHERE id = ?", (first,))
            # correlation's kind of update: not a message change, the index stays as it is
            store.execute("UPDATE events SET incident_id = NULL")
            store.insert_events(
                None, None, [Event(kind="oom", message="zebra EI0002 stripes", offset=1)], "t"
            )
        found = [r.event for r in reads.events(grep="EI0002")]
        assert first not in [e.id for e in found] and found[-1].message == "zebra EI0002 stripes"
        assert [r.event.message for r in reads.events(grep="zebra")] == ["zebra EI0002 stripes"]
        # the external-content index agrees with its table, row for row
        store.execute("INSERT INTO events_fts(events_fts, rank) VALUES ('integrity-check', 1)")
    finally:
        store.close()
    import sqlite_utils

    table = sqlite_utils.Database(db)["events"]
    assert isinstance(table, sqlite_utils.db.Table)
    assert table.detect_fts() == "events_fts"
    assert [r["message"] for r in table.search("zebra")] == ["zebra EI0002 stripes"]
    assert {fk.column: fk.other_table for fk in table.foreign_keys}.items() >= {
        "run_id": "runs",
        "source_id": "sources",
    }.items()


def test_an_older_database_gets_its_events_indexed(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(";".join(MIGRATIONS[:4]) + ";PRAGMA user_version=4;")
    conn.executemany(
        "INSERT INTO events(kind, ingested_at, offset, message) VALUES (?, ?, ?, ?)",
        [("comm_timeout", "2026-11-30T10:00:00.000Z", i, f"EI000{i} timed out") for i in range(3)],
    )
    conn.commit()
    conn.close()
    store = Store.open(db, readonly=True)  # an older schema is migrated once, then read
    try:
        version = store.execute("PRAGMA user_version").fetchone()[0]
        assert version == SCHEMA_VERSION
        assert [r.event.offset for r in Reads(store).events(grep="EI0001")] == [1]
        assert len(list(Reads(store).events(grep="timed out"))) == 3
    finally:
        store.close()


def test_records_and_filters(hccl: Path) -> None:
    store = Store.open(hccl, readonly=True)
    try:
        runs = Runs(store)
        (summary,) = runs.summaries()
        assert isinstance(summary, RunSummary) and summary.status == "failing"
        run = runs.by_name(summary.run.name)
        assert isinstance(run, Run) and run == summary.run and runs.by_name("nope") is None
        assert runs.names() == [run.name] == runs.names_of([run.id, 999])
        assert runs.facts(run.id) == run.facts
        reads = Reads(store)
        incidents = reads.incidents()
        assert incidents and all(isinstance(i, IncidentRow) for i in incidents)
        assert all(i.run == run for i in incidents)
        rank = incidents[0].incident.ranks[0]
        assert all(rank in i.incident.ranks for i in reads.incidents(rank=rank))
        assert reads.incidents(rank=12345) == []
        assert reads.incidents(status="resolved") == []
        assert len(reads.incidents(status="open")) == reads.open_count()
        rows = list(reads.events(rank=5))
        assert rows and all(isinstance(r, EventRow) and r.event.rank == 5 for r in rows)
        assert all(r.run == run.name and r.file for r in rows)
        assert list(reads.events(runs=["nope"])) == []
        iid = incidents[0].incident.id
        timeline = reads.timeline(iid)
        total = sum(t.count for t in timeline)
        assert total == len(list(reads.events(incident=iid)))
    finally:
        store.close()


def test_a_reader_that_stops_reading_ends_the_command_quietly(hccl: Path) -> None:
    """`nanwatch events | head`: the pipe closes before the output is written."""
    import os
    import subprocess

    from ..conftest import NANWATCH

    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write meets EPIPE
    try:
        proc = subprocess.run(
            [*NANWATCH, "events", "--db", str(hccl)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_rank_and_status_filters_on_the_command_line(hccl: Path, tmp_path: Path) -> None:
    every = events(hccl)
    five = [e for e in every if e["rank"] == 5]
    assert five and len(five) < len(every)
    assert events(hccl, "--rank", "5") == five
    assert [e["rank"] for e in events(hccl, "--rank", "0")] == [0]

    def incidents(db: Path, *args: str) -> list[dict[str, object]]:
        r = CliRunner().invoke(cli, ["incidents", "--db", str(db), "--json", *args])
        assert r.exit_code == 0, r.output
        return [json.loads(line) for line in r.stdout.splitlines()]

    every_incident = incidents(hccl)
    assert incidents(hccl, "--status", "open") == incidents(hccl, "--open") == every_incident
    assert incidents(hccl, "--status", "resolved") == []
    (one,) = every_incident[:1]
    ranks = one["ranks"]
    assert isinstance(ranks, list) and incidents(hccl, "--rank", str(ranks[0]))[0] == one
    assert incidents(hccl, "--rank", "4242") == []
    r = CliRunner().invoke(cli, ["incidents", "--db", str(hccl), "--rank", "4242"])
    assert r.exit_code == 0 and "No incidents. (with these filters" in r.output
    r = CliRunner().invoke(cli, ["incidents", "--db", str(hccl), "--open", "--status", "resolved"])
    assert r.exit_code == 2 and "contradict" in r.output
    r = CliRunner().invoke(cli, ["incidents", "--db", str(hccl), "--status", "shut"])
    assert r.exit_code == 2 and "open" in r.output and "resolved" in r.output

    db = tmp_path / "copy.db"
    shutil.copy(hccl, db)
    r = CliRunner().invoke(cli, ["resolve", str(one["id"]), "--db", str(db), "--note", "x"])
    assert r.exit_code == 0, r.output
    assert [i["id"] for i in incidents(db, "--status", "resolved")] == [one["id"]]
    assert one["id"] not in [i["id"] for i in incidents(db, "--status", "open")]
