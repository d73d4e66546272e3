"""Hostile and odd input: the daemon survives all of it in one run and loses nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config, SourcesConfig
from nanwatch.daemon.pipeline import Backoff, Pipeline
from nanwatch.errors import StoreError
from nanwatch.sources.discover import make_roots
from nanwatch.sources.watcher import choose_mode
from nanwatch.store import Store

from ..conftest import NANWATCH, StartWatch, wait_for
from ..integration.test_kill import event_count
from ..sources.test_sources import nan_line

pytestmark = pytest.mark.slow
ROOT = os.geteuid() == 0


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder an unprivileged user can use (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="nw-hostile-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def unprivileged() -> list[str]:
    """A command prefix that runs without the right to read others' files: a user namespace
    mapped to an ordinary uid (root would read a chmod 000 file)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("unshare") is None:
        return []
    probe = subprocess.run(
        ["unshare", "--user", "--map-user=1000", "--map-group=1000", "true"],
        capture_output=True,
        timeout=30,
    )
    return (
        ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
        if probe.returncode == 0
        else []
    )


def iters(db: Path) -> dict[int, int]:
    conn = sqlite3.connect(db)
    try:
        return dict(conn.execute("SELECT iter, count(*) FROM events GROUP BY iter").fetchall())
    except sqlite3.OperationalError:
        return {}  # the daemon created the file but not its tables yet
    finally:
        conn.close()


def iters_inside(pid: int, db: Path) -> dict[int, int]:
    """``iters`` of a database only the mount namespace of process ``pid`` can see (SQLite
    resolves /proc/PID/root to this namespace's /, so the reader runs in that namespace)."""
    code = (
        "import json, sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "print(json.dumps(c.execute('SELECT iter, count(*) FROM events GROUP BY iter').fetchall()))"
    )
    r = subprocess.run(
        ["nsenter", f"--target={pid}", "--user", "--mount", sys.executable, "-c", code, str(db)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return {int(i): int(n) for i, n in json.loads(r.stdout)} if r.returncode == 0 else {}


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def test_the_daemon_survives_everything_in_one_run(
    shared_dir: Path, start_watch: StartWatch
) -> None:
    logs = shared_dir / "logs"
    logs.mkdir()
    logs.chmod(0o777)
    db = shared_dir / "state" / "nw.db"
    db.parent.mkdir()
    db.parent.chmod(0o777)
    prefix = unprivileged()
    can_deny = bool(prefix) or not ROOT
    watch = start_watch(logs, db=db, verbose=1, prefix=prefix, out=shared_dir / "watch.out")
    # 1: a 50 MB line without a newline, then the rest of the file
    with (logs / "rank1.log").open("wb") as f:
        f.write(nan_line(1).encode())
        chunk = b"x" * (1 << 20)
        for _ in range(50):
            f.write(chunk)
            f.flush()
        f.write(b"\n" + nan_line(2).encode())
    # 2-5: NUL bytes, invalid UTF-8, GBK, CRLF
    (logs / "rank2.log").write_bytes(
        b"\x00\x00 boot \x00\n"
        + nan_line(3).encode().replace(b"INFO", b"INFO\x00")
        + b"\xff\xfe\xfa invalid \x80\n"
        + nan_line(4).encode()
        + "训练第 5 轮 ".encode("gbk")
        + nan_line(5).encode()
        + nan_line(6).encode().replace(b"\n", b"\r\n")
    )
    # 6: \r progress bars glued into one line
    bars = "".join(
        f"Epoch 1: {p}%|####      | {p}/100 [00:0{p % 10}<00:10]\r" for p in range(10, 60, 10)
    )
    (logs / "rank3.log").write_text(bars + nan_line(7))
    # 7: files that vanish while read (written, then deleted at once, repeatedly)
    # (each line its own iteration: a file read before it vanished gives each line once)
    for k in range(30):
        p = logs / f"tmp{k}.log"
        p.write_text("".join(nan_line(1000 + 50 * k + j) for j in range(50)))
        p.unlink()
    # 8: a file nanwatch may not read
    secret = logs / "rank4.log"
    secret.write_text(nan_line(8))
    secret.chmod(0o000)
    (logs / "rank5.log").write_text(nan_line(9))
    wait_for(
        lambda: {2, 3, 4, 5, 6, 7, 9} <= set(iters(db)),
        timeout=60,
        what="the events after the hostile input",
    )
    assert watch.running(), "the daemon died"
    peak = peak_rss_kib(watch.pid)
    assert watch.stop() == 0
    got = iters(db)
    assert all(n == 1 for n in got.values()), got
    for i in (1, 2, 3, 4, 5, 6, 7, 9):
        assert got.get(i) == 1, f"iteration {i}: {got.get(i)}"
    assert all(1000 <= i < 2500 for i in set(got) - {1, 2, 3, 4, 5, 6, 7, 8, 9})
    if can_deny:
        assert 8 not in got  # unreadable for the daemon's user
        assert "permission denied" in watch.output()
    conn = sqlite3.connect(db)
    cut = conn.execute("SELECT lines_cut FROM sources WHERE path LIKE '%rank1.log'").fetchone()
    conn.close()
    assert cut == (1,)
    assert peak < 300_000, f"peak RSS {peak} KiB while reading a 50 MB line"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_inotify_limit_falls_back_to_polling(tmp_path: Path, start_watch: StartWatch) -> None:
    logs = tmp_path / "logs"
    for k in range(40):
        (logs / f"node{k}").mkdir(parents=True)
    db = tmp_path / "nw.db"
    cfg = tmp_path / "nw.toml"
    cfg.write_text("[sources]\npoll_interval = 0.5\n")
    # a user namespace of its own, where the inotify limit can be lowered for this test only
    limit = 'echo 8 > /proc/sys/user/max_inotify_watches && exec "$@"'
    watch = start_watch(
        logs,
        db=db,
        config=cfg,
        verbose=1,
        ready=False,
        prefix=["unshare", "--user", "--map-root-user", "sh", "-c", limit, "sh"],
    )
    wait_for(
        lambda: "polling" in watch.output() or not watch.running(),
        timeout=30,
        what="the fallback to polling",
    )
    if not watch.running() and "Operation not permitted" in watch.output():
        pytest.skip("user namespaces are not allowed here")
    assert watch.running(), watch.output()
    watch.wait_ready()
    (logs / "node33" / "rank33.log").write_text(nan_line(33))
    wait_for(lambda: event_count(db) == 1, timeout=30, what="the event by polling")
    assert watch.stop() == 0
    text = watch.output()
    assert "inotify" in text and "poll" in text


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
@pytest.mark.skipif(shutil.which("nsenter") is None, reason="needs util-linux nsenter")
def test_a_full_disk_pauses_the_daemon_and_loses_nothing(
    tmp_path: Path, start_watch: StartWatch
) -> None:
    logs, mnt = tmp_path / "logs", tmp_path / "mnt"
    logs.mkdir()
    mnt.mkdir()
    # a small tmpfs in a mount namespace of the daemon's own; the test reaches it through
    # /proc/PID/root (the daemon's view of the file system) to fill it and to read the database
    tmpfs = f'mount -t tmpfs -o size=4000k tmpfs {mnt} && exec "$@"'
    watch = start_watch(
        logs,
        db=mnt / "nw.db",
        verbose=1,
        ready=False,
        prefix=["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", tmpfs, "sh"],
    )
    wait_for(
        lambda: "watching" in watch.output() or not watch.running(),
        timeout=30,
        what="the daemon",
    )
    if not watch.running():
        pytest.skip("cannot mount a tmpfs here: " + watch.output()[-300:])
    inside = Path(f"/proc/{watch.pid}/root") / mnt.relative_to("/")

    def got() -> dict[int, int]:
        return iters_inside(watch.pid, mnt / "nw.db")

    (logs / "rank0.log").write_text("".join(nan_line(i) for i in range(1, 11)))
    wait_for(lambda: set(got()) == set(range(1, 11)), timeout=30, what="the first events")
    with (inside / "ballast").open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    with (logs / "rank0.log").open("a") as f:
        for i in range(11, 1511):  # enough to need more pages than are left
            f.write(nan_line(i))
    wait_for(lambda: "paused" in watch.output(), timeout=60, what="the daemon to say it paused")
    assert watch.running()
    (inside / "ballast").unlink()
    wait_for(lambda: "resumed" in watch.output(), timeout=60, what="the daemon to resume")
    wait_for(lambda: len(got()) == 1510, timeout=60, what="every event after the resume")
    final = got()
    assert watch.stop() == 0, watch.output()[-2000:]
    assert set(final) == set(range(1, 1511)) and all(n == 1 for n in final.values())


def test_poll_mode_catches_writes(tmp_path: Path, start_watch: StartWatch) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    db = tmp_path / "nw.db"
    cfg = tmp_path / "nw.toml"
    cfg.write_text('[sources]\nmode = "poll"\npoll_interval = "0.3s"\n')
    watch = start_watch(logs, db=db, config=cfg, verbose=1)
    (logs / "rank0.log").write_text(nan_line(1))
    wait_for(lambda: event_count(db) == 1, timeout=30, what="the event by polling")
    with (logs / "rank0.log").open("a") as f:
        f.write(nan_line(2))
    wait_for(lambda: event_count(db) == 2, timeout=30, what="the second event")
    assert watch.stop() == 0
    assert "by poll" in watch.output()


def test_network_filesystems_are_polled(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "sysfs /sys sysfs rw 0 0\n"
        f"10.0.0.5:/export {tmp_path} nfs4 rw,relatime 0 0\n"
        "/dev/vda / ext4 rw 0 0\n"
    )
    (tmp_path / "logs").mkdir()
    mode, why = choose_mode("auto", make_roots([str(tmp_path / "logs")]), str(mounts))
    assert mode == "poll" and "nfs4" in why
    mode, _ = choose_mode("auto", make_roots([str(tmp_path / "logs")]), "/nonexistent")
    assert mode == "inotify"


def test_a_damaged_database_gives_a_clear_error_and_recovery(tmp_path: Path) -> None:
    db = tmp_path / "nw.db"
    db.write_bytes(b"this is not a database" * 100)
    (tmp_path / "logs").mkdir()
    r = subprocess.run(
        [*NANWATCH, "watch", "--db", str(db), str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 78  # EX_CONFIG: systemd does not restart it in a loop
    assert "damaged" in r.stderr and ".recover" in r.stderr and str(db) in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run(
        [*NANWATCH, "incidents", "--db", str(db)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "damaged" in r.stderr and "Traceback" not in r.stderr
    assert db.read_bytes() == b"this is not a database" * 100  # neither touched the file


def test_watchdog_stop_race_is_not_shown_as_an_error(caplog):
    """watchdog's benign 'queue_events() called when the thread is inactive' at unschedule/stop
    is dropped; its other errors still reach the log."""
    import logging

    import nanwatch.sources.watcher  # noqa: F401  (installs the filter)

    wlog = logging.getLogger("watchdog.observers.inotify")
    with caplog.at_level(logging.ERROR, logger="watchdog.observers.inotify"):
        wlog.error("InotifyEmitter.queue_events() called when the thread is inactive")
        wlog.error("something else went wrong")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something else went wrong"]


def test_a_file_made_readable_is_followed_without_a_rescan(
    shared_dir: Path, start_watch: StartWatch
) -> None:
    """chmod comes as an attribute change: the file is read then, not at the next full walk
    (pushed out of reach here, so only the watcher can bring the line)."""
    prefix = unprivileged()
    if ROOT and not prefix:
        pytest.skip("needs an unprivileged user (unshare) to be refused a chmod 000 file")
    logs = shared_dir / "logs"
    logs.mkdir()
    logs.chmod(0o777)
    secret = logs / "rank4.log"
    secret.write_text(nan_line(8))
    secret.chmod(0o000)
    (logs / "rank5.log").write_text(nan_line(9))
    db = shared_dir / "state" / "nw.db"
    db.parent.mkdir()
    db.parent.chmod(0o777)
    code = (
        "import sys, nanwatch.daemon.pipeline as p; p.SAFETY_POLL = 3600.0; "
        "from nanwatch.cli import main; sys.argv[0] = 'nanwatch'; main()"
    )
    watch = start_watch(
        logs,
        db=db,
        verbose=1,
        prefix=prefix,
        command=[sys.executable, "-c", code],
        out=shared_dir / "watch.out",
        cwd=Path(__file__).resolve().parents[2],
    )
    assert 9 in iters(db)  # ready: the first pass read the readable file
    assert "permission denied" in watch.output()
    assert 8 not in iters(db)
    secret.chmod(0o644)
    wait_for(lambda: 8 in iters(db), timeout=10, what="the file made readable")
    assert watch.stop() == 0
    assert iters(db) == {8: 1, 9: 1}


def _limit_pages(store: Store, pages: int | None) -> None:
    """The database can grow no further (SQLITE_FULL, as on a full disk), or again freely."""
    if pages is None:
        pages = 1 << 30
    store.execute(f"PRAGMA max_page_count={pages}")


def _feeds(pipe: Pipeline) -> list[int]:
    """The size of every chunk handed to detection (a spy around the real detector)."""
    fed: list[int] = []
    real, real_columns = pipe.detector.feed, pipe.detector.feed_columns

    def feed(data: bytes, *args: Any, **kw: Any) -> Any:
        fed.append(len(data))
        return real(data, *args, **kw)

    def feed_columns(data: bytes, *args: Any, **kw: Any) -> Any:
        fed.append(len(data))
        return real_columns(data, *args, **kw)

    pipe.detector.feed = feed  # type: ignore[method-assign]
    pipe.detector.feed_columns = feed_columns  # type: ignore[method-assign]
    return fed


def test_a_refused_commit_is_retried_without_reading_or_detecting_again(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text(nan_line(1))
    db = tmp_path / "nw.db"
    store = Store.open(db)
    pipe = Pipeline(Config(), store, [str(logs)], live=True)
    try:
        pipe.step()
        fed = _feeds(pipe)
        with log.open("a") as f:
            f.write("".join(nan_line(i) for i in range(2, 3002)))
        _limit_pages(store, store._conn.execute("PRAGMA page_count").fetchone()[0])
        for _ in range(4):
            with pytest.raises(StoreError, match="full"):
                pipe.step()
        assert sum(fed) == log.stat().st_size - len(nan_line(1))  # detected once, kept
        _limit_pages(store, None)
        pipe.step()
        pipe.step()
        assert sum(fed) == log.stat().st_size - len(nan_line(1))
    finally:
        pipe.tracker.close()
        store.close()
    got = iters(db)
    assert set(got) == set(range(1, 3002)) and all(n == 1 for n in got.values())


def test_backoff_doubles_to_its_cap_on_its_own_clock() -> None:
    now = [100.0]
    b = Backoff(first=1.0, cap=60.0, clock=lambda: now[0])
    assert b.due()
    assert [b.failed() for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert not b.due() and b.left() == 60
    now[0] += 59.5
    assert not b.due()
    now[0] += 0.5
    assert b.due()
    b.reset()
    assert b.failed() == 1


def test_a_paused_watch_retries_on_its_backoff_not_on_every_wake_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text("".join(nan_line(i) for i in range(1, 3001)))
    db = tmp_path / "nw.db"
    store = Store.open(db)
    _limit_pages(store, store._conn.execute("PRAGMA page_count").fetchone()[0])
    pipe = Pipeline(Config(sources=SourcesConfig(mode="inotify")), store, [str(logs)], live=True)
    now = [0.0]
    pipe.retry = Backoff(clock=lambda: now[0])
    fed = _feeds(pipe)
    attempts: list[int] = []
    real_write = pipe.committer.write

    def write(batch: Any) -> None:
        attempts.append(len(batch))
        real_write(batch)

    pipe.committer.write = write  # type: ignore[method-assign]
    ticks = [0]
    release = threading.Event()

    def on_tick() -> None:  # the writer thread's own hook: the only one to touch the store
        ticks[0] += 1
        if release.is_set():
            _limit_pages(store, None)

    stop = threading.Event()
    t = threading.Thread(target=pipe.watch, args=(stop,), kwargs={"on_tick": on_tick})
    t.start()
    try:
        wait_for(lambda: pipe.paused is not None, timeout=30, what="the pause")
        first = sum(fed)
        assert attempts == [attempts[0]] and first == log.stat().st_size
        for i in range(3001, 3006):  # wake-ups while the disk is full
            seen = ticks[0]
            with log.open("a") as f:
                f.write(nan_line(i))
            wait_for(lambda s=seen: ticks[0] > s, timeout=10, what="a wake-up")
        assert len(attempts) == 1 and sum(fed) == first
        now[0] += 1.0  # its turn: one attempt, refused again, nothing read
        pipe.wake.set()
        wait_for(lambda: pipe.retry.delay == 2.0, timeout=10, what="the second attempt")
        assert len(attempts) == 2 and pipe.paused is not None and sum(fed) == first
        release.set()
        seen = ticks[0]
        pipe.wake.set()
        wait_for(lambda: ticks[0] > seen, timeout=10, what="the release")
        now[0] += 2.0
        pipe.wake.set()
        wait_for(lambda: pipe.paused is None, timeout=30, what="the resume")
        wait_for(lambda: len(iters(db)) == 3005, timeout=30, what="every event")
        assert pipe.retry.delay == 0.0
        assert sum(fed) == log.stat().st_size  # every byte detected once
    finally:
        stop.set()
        pipe.request_stop()
        t.join(30)
        store.close()
    got = iters(db)
    assert set(got) == set(range(1, 3006)) and all(n == 1 for n in got.values())
