"""A database with garbage pages in the middle: every command says so, with the recovery steps.

`watch` exits 78 (systemd's RestartPreventExitStatus: restarting cannot mend a file) instead of
looping; read commands exit non-zero instead of printing what the intact pages still hold.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.errors import StoreError
from nanwatch.store import Store
from nanwatch.store.db import check_integrity, recovery_steps

from ..conftest import NANWATCH, nanwatch

LINE = (
    "2026/11/30 10:{m:02d}:{s:02d} - mmengine - INFO - Epoch(train)  [1][{i}/3000]  "
    "lr: 1.0000e-04  eta: 0:10:00  time: 0.5000  data_time: 0.0100  memory: 10000  "
    "loss: nan  grad_norm: nan\n"
)


def _database(tmp_path: Path) -> Path:
    """A real database of a few hundred pages, written by `scan`."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text(
        "".join(LINE.format(m=i // 60 % 60, s=i % 60, i=i) for i in range(1, 3001))
    )
    db = tmp_path / "nw.db"
    nanwatch("scan", "--db", str(db), str(logs))
    return db


def _damage(db: Path) -> None:
    """Garbage over a fifth of the pages, from the middle of the file; the header is intact."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.close()
    assert pages > 100
    with open(db, "r+b") as f:
        f.seek(page * (pages // 2))
        f.write(os.urandom(page * (pages // 5)))


@pytest.fixture
def damaged_db(tmp_path: Path) -> Path:
    db = _database(tmp_path)
    _damage(db)
    return db


def test_watch_exits_78_with_the_recovery_steps(damaged_db: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [*NANWATCH, "watch", "--db", str(damaged_db), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 78, r.stderr
    assert "Traceback" not in r.stderr
    assert f"{damaged_db}: the database is damaged" in r.stderr
    assert recovery_steps(damaged_db) in r.stderr
    # doctor gives the same steps
    doctor = CliRunner().invoke(cli, ["doctor", "--db", str(damaged_db)])
    assert recovery_steps(damaged_db) in " ".join(doctor.output.split())


@pytest.mark.parametrize(
    "args",
    [["incidents"], ["incidents", "--json"], ["events", "--limit", "2"], ["show", "1"], ["runs"]],
)
def test_read_commands_say_the_file_is_damaged(damaged_db: Path, args: list[str]) -> None:
    r = CliRunner().invoke(cli, [*args, "--db", str(damaged_db)])
    assert r.exit_code != 0, r.output
    assert isinstance(r.exception, SystemExit), r.exception
    assert f"{damaged_db}: the database is damaged" in r.output, r.output
    assert ".recover" in r.output


def test_scan_refuses_a_damaged_database(damaged_db: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["scan", "--db", str(damaged_db), str(tmp_path / "logs")])
    assert r.exit_code != 0 and "the database is damaged" in r.output, r.output


def test_an_intact_database_opens_and_the_check_is_bounded(tmp_path: Path) -> None:
    db = _database(tmp_path)
    store = Store.open(db, readonly=True)
    try:
        assert check_integrity(store._conn, db, 10.0) is True
        # no time left: the check gives up (unchecked) rather than delaying the start
        assert check_integrity(store._conn, db, -1.0) is False
    finally:
        store.close()
    assert CliRunner().invoke(cli, ["incidents", "--db", str(db)]).exit_code == 0


def test_damage_met_during_a_pass_stops_watch_instead_of_pausing(tmp_path: Path) -> None:
    """Pages the writer reads again after the check (its cache evicted) turn out garbage: the
    loop stops with the damaged error; it does not pause and retry forever as for a full disk."""
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text("".join(LINE.format(m=i // 60 % 60, s=i % 60, i=i) for i in range(1, 3001)))
    db = tmp_path / "nw.db"
    store = Store.open(db)
    pipe = Pipeline(Config(), store, [str(logs)], live=True)
    stop = threading.Event()
    guard = threading.Timer(30, stop.set)  # only so that a failing run ends
    try:
        pipe.step()
        store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        _damage(db)
        store._conn.execute("PRAGMA shrink_memory")  # what memory pressure does to the cache
        with log.open("a") as f:
            f.write("".join(LINE.format(m=i // 60 % 60, s=i % 60, i=i) for i in range(3001, 4001)))
        guard.start()
        with pytest.raises(StoreError) as e:
            pipe.watch(stop)
        assert e.value.damaged and "the database is damaged" in str(e.value)
        assert not stop.is_set(), "watch paused on the damage instead of stopping"
    finally:
        guard.cancel()
        guard.join()
        pipe.tracker.close()
        store.close()
