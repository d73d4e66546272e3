"""Real processes: SIGKILL `watch` while a writer appends; nothing lost, nothing duplicated."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ..conftest import NANWATCH, ROOT, StartWatch, wait_for
from ..sources.test_sources import nan_line

pytestmark = pytest.mark.slow


def event_count(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def caught_up(db: Path, logs: Path) -> bool:
    """Every file below ``logs`` is committed to its last byte (files known by device and
    inode, as the daemon knows them): nothing is left that could still become an event."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute("SELECT dev, ino, offset FROM sources").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return False
    committed = {(dev, ino): off for dev, ino, off in rows}
    for p in logs.rglob("*"):
        if p.is_file():
            st = p.stat()
            if committed.get((st.st_dev, st.st_ino)) != st.st_size:
                return False
    return True


def test_sigkill_loses_and_duplicates_nothing(tmp_path: Path, start_watch: StartWatch) -> None:
    seed = int(os.environ.get("NANWATCH_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    logs = tmp_path / "logs"
    logs.mkdir()
    db = tmp_path / "nw.db"
    out = tmp_path / "watch.out"
    ranks, per_rank = 3, 200
    done = threading.Event()
    written = [0]

    def writer() -> None:
        handles = [open(logs / f"rank{r}.log", "a", buffering=1) for r in range(ranks)]  # noqa: SIM115
        try:
            for i in range(1, per_rank + 1):
                for h in handles:
                    h.write(nan_line(i))
                written[0] = i
                # paces the writer like a training loop, so the kills land while it writes;
                # the kill points are iterations, no assertion depends on this duration
                time.sleep(0.02)
        finally:
            for h in handles:
                h.close()
            done.set()

    t = threading.Thread(target=writer, name="writer")
    watch = start_watch(logs, db=db, out=out, ready=False)
    t.start()
    try:
        # each kill comes once the process has committed something and the writer has
        # passed a random iteration: an instant inside a pass, chosen by progress, not time
        for at in sorted(rng.sample(range(10, per_rank), 3)):
            before = event_count(db)
            wait_for(
                lambda b=before: event_count(db) > b or done.is_set(),
                timeout=60,
                what="a commit by the restarted process",
            )
            wait_for(lambda a=at: written[0] >= a, timeout=60, what=f"iteration {at}")
            assert watch.kill() == -signal.SIGKILL
            watch = start_watch(logs, db=db, out=out, ready=False)
        t.join(60)
        assert done.is_set()
        wait_for(lambda: caught_up(db, logs), timeout=60, what="every byte committed")
        assert watch.stop() == 0, watch.output()
    finally:
        t.join(60)
    conn = sqlite3.connect(db)
    rows = conn.execute(
        "SELECT s.path, e.iter FROM events e JOIN sources s ON s.id = e.source_id"
    ).fetchall()
    conn.close()
    got = sorted((Path(p).name, i) for p, i in rows)
    want = sorted((f"rank{r}.log", i) for r in range(ranks) for i in range(1, per_rank + 1))
    assert got == want, f"seed {seed}: {len(got)} events, want {len(want)}"


def test_sigterm_exits_zero_quickly(tmp_path: Path, start_watch: StartWatch) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text(nan_line(1))
    db = tmp_path / "nw.db"
    watch = start_watch(logs, db=db)
    assert event_count(db) == 1  # ready: the first pass is committed
    # the bound is the daemon's own promise (systemd's stop timeout is far longer)
    assert watch.stop(timeout=5) == 0
    assert "stopped: everything read is committed" in watch.output()


def test_one_writer_per_database_but_silences_still_work(
    tmp_path: Path, start_watch: StartWatch
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text(nan_line(1))
    db = tmp_path / "nw.db"
    watch = start_watch(logs, db=db)
    assert event_count(db) == 1
    second = subprocess.run(
        [*NANWATCH, "scan", "--db", str(db), str(logs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert f"pid {watch.pid}" in second.stderr and "another nanwatch process" in second.stderr
    silence = subprocess.run(
        [*NANWATCH, "silence", "--db", str(db), "--kind", "nan", "--for", "2h"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert silence.returncode == 0, silence.stderr
    assert watch.stop() == 0


def test_a_second_writer_through_another_name_is_refused(
    tmp_path: Path, start_watch: StartWatch
) -> None:
    """The lock is the database file's, not its name's: a symlink, a hard link or a relative
    path to a database being written is refused, naming the writer; readers still read."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("".join(nan_line(i) for i in range(1, 51)))
    db = tmp_path / "nw.db"
    watch = start_watch(logs, db=db)
    assert event_count(db) == 50
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "sym.db").symlink_to(db)
    os.link(db, other / "hard.db")
    names = [str(other / "sym.db"), str(other / "hard.db"), os.path.relpath(db, other)]
    for name in names:
        second = subprocess.run(
            [*NANWATCH, "scan", "--db", name, str(logs)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=other,  # the relative name is relative to here; this checkout is imported
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert second.returncode == 1, (name, second.stdout, second.stderr)
        assert f"pid {watch.pid}" in second.stderr, (name, second.stderr)
        assert "another nanwatch process" in second.stderr
    reader = subprocess.run(
        [*NANWATCH, "events", "--db", str(db), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reader.returncode == 0, reader.stderr
    assert len(reader.stdout.splitlines()) == 50
    assert watch.stop() == 0
    assert event_count(db) == 50
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        conn.close()


def test_the_lock_holder_is_read_from_the_kernels_table(tmp_path: Path) -> None:
    from nanwatch.store.db import _flock_holder

    table = tmp_path / "locks"
    table.write_text(
        "1: POSIX  ADVISORY  READ 11 fe:00:77 1073741826 1073742335\n"
        "2: FLOCK  ADVISORY  WRITE 4242 fe:00:77 0 EOF\n"
        "2: -> FLOCK  ADVISORY  WRITE 4343 fe:00:77 0 EOF\n"
        "3: FLOCK  ADVISORY  WRITE 5151 00:2a:99 0 EOF\n"
    )
    dev = os.makedev(0xFE, 0)
    assert _flock_holder(dev, 77, str(table)) == 4242
    # another device number for the same inode (btrfs subvolumes): still found when alone
    assert _flock_holder(os.makedev(0, 0x31), 99, str(table)) == 5151
    assert _flock_holder(dev, 12345, str(table)) is None
    assert _flock_holder(dev, 77, str(tmp_path / "missing")) is None
