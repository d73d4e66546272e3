"""The pass loop's parts: sources through their repository, file decisions on their records,
composition instead of inheritance, and no SQL outside the store."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nanwatch
from nanwatch.config import Config
from nanwatch.daemon.passes import Passes
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.sources.copies import CopyJudge
from nanwatch.sources.tailer import Tracker
from nanwatch.store import Store
from nanwatch.store.records import Source
from nanwatch.store.sources import SourceRuns, Sources

PACKAGE = Path(nanwatch.__file__).parent
# the pass loop and the sources stage: every read and write goes through nanwatch.store
NO_SQL = [
    "daemon/passes.py",
    "daemon/pipeline.py",
    "daemon/committer.py",
    "daemon/router.py",
    "daemon/run_identity.py",
    "stream.py",
    "sources/identity.py",
    "sources/tailer.py",
    "sources/copies.py",
    "sources/runs.py",
]
_SQL = re.compile(r"""["'](?:SELECT|INSERT|UPDATE|DELETE|BEGIN|PRAGMA)\b""", re.IGNORECASE)


def _line(i: int) -> str:
    return (
        f"2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [1][{i}/100]  "
        f"lr: 1.0000e-04  eta: 0:01:00  time: 0.5000  data_time: 0.0100  memory: 100  loss: nan\n"
    )


def _source(**kw: object) -> Source:
    base: dict[str, object] = dict(
        id=None,
        run_id=None,
        path="/logs/rank0.log",
        root="/logs",
        dev=1,
        ino=2,
        gen=0,
        offset=10,
        head_hash="h",
        head_len=10,
        tail_hash="t",
        cutting=False,
        lines_cut=0,
        status="active",
        ctx='{"line_no": 1}',
    )
    base.update(kw)
    return Source(**base)  # type: ignore[arg-type]


def test_sources_are_saved_loaded_renamed_and_retired_through_their_repository(
    db: Path,
) -> None:
    store = Store.open(db)
    try:
        sources = Sources(store)
        run = store.run_id("/logs", "", "logs")
        with store.transaction():
            sid = sources.save(_source(run_id=run))
        assert sources.load() == [_source(id=sid, run_id=run)]
        with store.transaction():
            assert sources.save(_source(id=sid, run_id=None, offset=99, tail_hash="u")) == sid
            sources.rename(sid, "/logs/rank0.log.1")
        # a record without its run keeps the stored one
        got = sources.load()
        assert got == [_source(id=sid, run_id=run, offset=99, tail_hash="u", path=got[0].path)]
        assert got[0].path == "/logs/rank0.log.1"
        # the same identity saved by a record that does not know its row: one row, updated
        with store.transaction():
            assert sources.save(_source(run_id=run, offset=5)) == sid
        assert [s.offset for s in sources.load()] == [5]
        assert sources.next_gen(1, 2) == 1 and sources.next_gen(1, 3) == 0
        sources.set_status(sid, "rotated")
        assert [s.status for s in sources.load()] == ["rotated"]  # a twin for copies
        sources.set_status(sid, "gone")
        assert sources.load() == []
        runs = SourceRuns(store)
        runs.set_identity(run, job="j", cluster_run="r", node="n1")
        got_run = runs.get(run)
        assert got_run is not None and (got_run.job, got_run.cluster_run, got_run.node) == (
            "j",
            "r",
            "n1",
        )
        assert runs.get(run + 1) is None
    finally:
        store.close()


def test_a_file_renamed_out_of_sight_is_stored_retired_once(tmp_path: Path, db: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text(_line(1))
    store = Store.open(db)
    pipe = Pipeline(Config(), store, [str(logs)], live=True)
    try:
        pipe.step()
        (rec,) = pipe.tracker.records.values()
        os.rename(log, tmp_path / "elsewhere.log")  # out of the roots, still open here
        pipe.step()
        assert rec.status == "rotated" and rec.saved_status == "rotated"
        status = store._conn.execute("SELECT status FROM sources WHERE id = ?", (rec.id,))
        assert status.fetchone()[0] == "rotated"
        before = store._conn.total_changes
        pipe.step()  # the decision is stored: nothing is written again
        assert store._conn.total_changes == before
    finally:
        pipe.tracker.close()
        store.close()


def test_the_pass_loop_is_composed_not_inherited(tmp_path: Path, db: Path) -> None:
    assert Passes not in Pipeline.__mro__ and CopyJudge not in Tracker.__mro__
    store = Store.open(db)
    pipe = Pipeline(Config(), store, [str(tmp_path)])
    try:
        assert isinstance(pipe.passes, Passes)
        assert isinstance(pipe.tracker.copies, CopyJudge)
        assert pipe.tracker.copies.files is pipe.tracker
    finally:
        pipe.tracker.close()
        store.close()


def test_the_pass_loop_has_no_sql_of_its_own() -> None:
    found = []
    for name in NO_SQL:
        text = (PACKAGE / name).read_text()
        for n, line in enumerate(text.splitlines(), 1):
            if "._conn" in line or "import sqlite3" in line or _SQL.search(line):
                found.append(f"{name}:{n}: {line.strip()}")
    assert found == []
    # metrics are written in one place (their storage is swapped there)
    calls = sum((PACKAGE / name).read_text().count("insert_metrics(") for name in NO_SQL)
    assert calls == 1
