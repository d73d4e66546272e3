"""A scan that detects in worker processes stores exactly what a serial scan stores."""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest

import nanwatch.daemon.passes as passes_module
import nanwatch.detect.pool as pool_module
from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import npu_oom_traceback, seed_scenario
from nanwatch.detect.pool import usable_workers
from nanwatch.store import Store
from nanwatch.store.metrics import Metrics

TABLES = {
    "events": "SELECT e.id, e.kind, e.time, s.path, e.offset, e.key, e.line, e.rank, "
    "e.local_rank, e.node, e.epoch, e.iter, e.step, e.stage, e.device, e.message, e.fields, "
    "e.incident_id FROM events e JOIN sources s ON s.id = e.source_id ORDER BY e.id",
    "incidents": "SELECT id, kind, title, status, ranks, first_time, last_time, event_count, "
    "origin, hints FROM incidents ORDER BY id",
    "sources": "SELECT path, gen, offset, head_hash, tail_hash, ctx, status FROM sources "
    "ORDER BY path, gen",
}


def scan(db: Path, path: Path) -> dict[str, list[Any]]:
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(path)])
        pipe.tracker.read_chunk = 64 << 10  # streams of many chunks
        pipe.scan()
    finally:
        store.close()
    conn = sqlite3.connect(db)
    try:
        got = {name: conn.execute(sql).fetchall() for name, sql in TABLES.items()}
        paths = dict(conn.execute("SELECT id, path FROM sources").fetchall())
    finally:
        conn.close()
    store = Store.open(db, readonly=True)
    try:
        # every stored iteration, in the order it was stored, with its file
        got["metrics"] = [(paths[m.source_id], *astuple(m)[3:]) for m in Metrics(store).rows()]
    finally:
        store.close()
    return got


def test_parallel_scan_stores_what_a_serial_scan_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the seed case (OOM + HCCL timeouts, msprobe NaN, slowdown), plus rank logs whose last
    # line has no newline yet and a log with a traceback split over two chunks
    base = tmp_path / "logs"
    for run in seed_scenario(base):
        run.write()
    launch = base / "work_dirs" / "dino-4scale_r50_8xb2-12e_coco" / "20261130_101500"
    with (launch / "rank5.log").open("a") as f:
        f.write("\n".join(npu_oom_traceback(5)))  # unterminated: only a scan reads it
    monkeypatch.setenv("NANWATCH_SCAN_WORKERS", "0")
    serial = scan(tmp_path / "serial.db", base)
    # every text file to the workers
    monkeypatch.setenv("NANWATCH_SCAN_WORKERS", "2")
    monkeypatch.setattr(passes_module, "POOL_MIN_BYTES", 0)
    used: list[int] = []
    real = pool_module.DetectorPool

    def pool(detector: Any, workers: int, **kw: Any) -> Any:
        used.append(workers)
        return real(detector, workers, **kw)

    monkeypatch.setattr(pool_module, "DetectorPool", pool)
    parallel = scan(tmp_path / "parallel.db", base)
    assert used == [2]
    assert serial["events"] and serial["metrics"] and serial["incidents"]
    for name in TABLES:
        assert parallel[name] == serial[name], name


def test_no_workers_while_another_thread_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANWATCH_SCAN_WORKERS", "2")
    assert usable_workers() == 2
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy")
    t.start()
    try:
        assert usable_workers() == 0  # forking a threaded process can deadlock the child
    finally:
        stop.set()
        t.join()
    monkeypatch.setenv("NANWATCH_SCAN_WORKERS", "1")
    assert usable_workers() == 0
