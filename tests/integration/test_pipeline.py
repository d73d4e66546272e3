"""The pipeline: runs, idempotent scans, incidents."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import TrainingRun
from nanwatch.query import list_incidents, list_runs
from nanwatch.store import Store

from ..sources.test_sources import nan_line, ok_line


def scan(db: Path, *paths: str, run: str | None = None) -> Pipeline:
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, list(paths), run=run)
        pipe.scan()
        return pipe
    finally:
        store.close()


def count(db: Path, sql: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def test_scan_twice_adds_nothing(tmp_path: Path, db: Path) -> None:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=3)
    run.write()
    scan(db, str(run.work_dir))
    n = count(db, "SELECT count(*) FROM events")
    m = count(db, "SELECT sum(n) FROM metric_blocks")
    assert n > 0 and m > 0
    scan(db, str(run.work_dir))
    assert count(db, "SELECT count(*) FROM events") == n
    assert count(db, "SELECT sum(n) FROM metric_blocks") == m
    assert count(db, "SELECT count(*) FROM incidents") == 1


def test_origin_is_earliest_step_then_rank(tmp_path: Path, db: Path) -> None:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=8, nan_rank=6, nan_at=(1, 10))
    run.write()
    scan(db, str(run.work_dir))
    store = Store.open(db, readonly=True)
    (inc,) = list_incidents(store._conn)
    store.close()
    assert inc["kind"] == "nan"
    assert inc["origin"]["rank"] == 6
    assert (inc["origin"]["epoch"], inc["origin"]["iter"], inc["origin"]["step"]) == (1, 10, 10)
    assert inc["ranks"] == list(range(8))


def test_launch_folders_split_into_runs_of_one_experiment(tmp_path: Path, db: Path) -> None:
    wd = tmp_path / "work_dirs" / "dino"
    TrainingRun(wd, timestamp="20261130_101500", ranks=2, nan_rank=1).write()
    TrainingRun(wd, timestamp="20261201_090000", ranks=2, nan_rank=0).write()
    scan(db, str(wd))
    store = Store.open(db, readonly=True)
    runs = list_runs(store._conn)
    incidents = list_incidents(store._conn)
    store.close()
    assert [r["name"] for r in runs] == ["dino/20261130_101500", "dino/20261201_090000"]
    assert {r["experiment"] for r in runs} == {"dino"}
    # events of different runs never merge
    assert len(incidents) == 2
    assert sorted(i["origin"]["rank"] for i in incidents) == [0, 1]


def test_forced_run_name(tmp_path: Path, db: Path) -> None:
    a = TrainingRun(tmp_path / "a", ranks=1, nan_rank=0)
    b = TrainingRun(tmp_path / "b", ranks=1, nan_rank=0)
    a.write()
    b.write()
    scan(db, str(a.work_dir), str(b.work_dir), run="job42")
    store = Store.open(db, readonly=True)
    runs = list_runs(store._conn)
    incidents = list_incidents(store._conn)
    store.close()
    assert [r["name"] for r in runs] == ["job42"]
    assert len(incidents) == 1


def test_each_path_is_one_run(tmp_path: Path, db: Path) -> None:
    for name in ("job1", "job2"):
        d = tmp_path / name
        d.mkdir()
        (d / "rank0.log").write_text(
            "2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [1][5/10]  lr: 1e-4  "
            "eta: 0:00:10  time: 0.5  data_time: 0.01  memory: 1  loss: nan\n"
        )
    scan(db, str(tmp_path / "job1"), str(tmp_path / "job2"))
    store = Store.open(db, readonly=True)
    assert [r["name"] for r in list_runs(store._conn)] == ["job1", "job2"]
    assert len(list_incidents(store._conn)) == 2
    store.close()


def test_unterminated_last_line_is_detected_by_scan_but_not_committed(
    tmp_path: Path, db: Path
) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    log = d / "rank0.log"
    line = (
        "2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [1][5/10]  lr: 1e-4  "
        "eta: 0:00:10  time: 0.5  data_time: 0.01  memory: 1  loss: nan"
    )
    log.write_text(line)  # a crash left no newline
    scan(db, str(d))
    assert count(db, "SELECT count(*) FROM events") == 1
    assert count(db, "SELECT offset FROM sources") == 0
    with log.open("a") as f:
        f.write("\n")
    scan(db, str(d))
    assert count(db, "SELECT count(*) FROM events") == 1  # same bytes, same row
    assert count(db, "SELECT offset FROM sources") == len(line) + 1


def test_stdout_written_before_the_launch_folder_joins_that_launch(
    tmp_path: Path, db: Path
) -> None:
    """torchrun prints its banner to the captured stdout before mmengine makes its folder."""
    work = tmp_path / "work_dirs" / "toy"
    work.mkdir(parents=True)
    (work / "stdout.log").write_text(
        "WARNING:torch.distributed.run:Setting OMP_NUM_THREADS environment variable for each "
        "process to be 1 in default, to avoid your system being overloaded.\n"
    )
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(work)], live=True)
        pipe.step()
        run = TrainingRun(work, timestamp="20261130_101500", ranks=1, nan_rank=0, nan_at=(1, 3))
        run.write()
        with (work / "stdout.log").open("a") as f:
            f.write(run.rank_path(0).read_text())
        pipe.step()
        runs = list_runs(store._conn)
        pipe.tracker.close()
    finally:
        store.close()
    assert [r["name"] for r in runs] == ["toy/20261130_101500"]
    assert runs[0]["experiment"] == "toy" and runs[0]["sources"] == 2


def test_a_stop_in_the_middle_of_a_catch_up_commits_what_was_read(
    tmp_path: Path, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during a long first pass: the pass stops reading, commits, and returns; the
    next start resumes where it stopped, with nothing lost or duplicated."""
    import threading

    from nanwatch.daemon import pipeline

    logs = tmp_path / "logs"
    logs.mkdir()
    # 40 MiB of iteration lines behind: more than two commit batches
    line = ok_line(1)
    n = (40 << 20) // len(line)
    (logs / "rank0.log").write_text(line * n + nan_line(2))
    monkeypatch.setattr(pipeline, "STOP_GRACE", 0.0)
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(logs)], live=True)
        pipe.on_progress = pipe.request_stop  # the signal arrives after the first commit
        pipe.watch(threading.Event())
        offset = store._conn.execute("SELECT max(offset) FROM sources").fetchone()[0]
        pipe.tracker.close()
    finally:
        store.close()
    assert 0 < offset < (logs / "rank0.log").stat().st_size
    assert offset % len(line) == 0  # a whole number of lines
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(logs)])
        pipe.scan()
        events = store._conn.execute("SELECT count(*) FROM events").fetchone()[0]
        pipe.tracker.close()
    finally:
        store.close()
    assert events == 1
