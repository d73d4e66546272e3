"""The service as real processes: the notify socket, signals, reload, metrics, WAL readers."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import sqlite3
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from ..conftest import StartWatch, Watch, nanwatch, wait_for
from ..sources.test_sources import nan_line, ok_line

pytestmark = pytest.mark.slow


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket, by path or in the abstract namespace."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.received: list[tuple[float, dict[str, str]]] = []

    def _recv(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return None
        msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.received.append((time.monotonic(), msg))
        return msg

    def wait(self, key: str, value: str | None = None, timeout: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(deadline - time.monotonic())
            if msg is not None and key in msg and (value is None or msg[key] == value):
                return msg
        raise AssertionError(f"no {key}={value or '*'} within {timeout}s; got {self.received}")

    def collect(self, seconds: float) -> list[tuple[float, dict[str, str]]]:
        start = len(self.received)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._recv(deadline - time.monotonic())
        return self.received[start:]

    def drain(self) -> None:
        while self._recv(0.001) is not None:
            pass

    def close(self) -> None:
        self.sock.close()
        if not self.address.startswith("@"):
            Path(self.address).unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: Path, sources: list[Path], extra: str = "") -> Path:
    paths = ", ".join(f'"{p}"' for p in sources)
    path.write_text(f"[sources]\npaths = [{paths}]\n{extra}")
    return path


StartDaemon = Callable[..., Watch]


@pytest.fixture
def start_daemon(tmp_path: Path, start_watch: StartWatch) -> StartDaemon:
    """``start_daemon(config, notify, watchdog_usec=..., journal=...)``: `watch` as systemd
    runs it (its readiness is on the notify socket, so the test waits there)."""

    def start(
        config: Path,
        notify: NotifySocket | None = None,
        *,
        watchdog_usec: int | None = None,
        journal: bool = False,
    ) -> Watch:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        if notify is not None:
            env["NOTIFY_SOCKET"] = notify.address
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        out = tmp_path / "daemon.err"
        out.touch()
        if journal:  # what systemd sets when stderr is a journal stream
            st = out.stat()
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        return start_watch(config=config, db=tmp_path / "nw.db", out=out, env=env, ready=False)

    return start


def count(db: Path, sql: str = "SELECT count(*) FROM events") -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    (d / "rank0.log").write_text(nan_line(1))
    return d


def test_ready_watchdog_and_stopping_on_a_path_socket(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(
        write_config(tmp_path / "nw.toml", [logs]), notify, watchdog_usec=3_000_000
    )
    try:
        ready = notify.wait("READY", "1")
        assert "following 1 file(s)" in ready["STATUS"] and "1 open incident(s)" in ready["STATUS"]
        t0 = notify.received[-1][0]
        pings = [t for t, m in notify.collect(5.0) if m.get("WATCHDOG") == "1"]
        # systemd kills a service that stays silent for WatchdogSec (3s here)
        assert len(pings) >= 2, notify.received
        gaps = [b - a for a, b in zip([t0, *pings], pings)]
        assert max(gaps) < 3.0, gaps
        daemon.send(signal.SIGTERM)
        notify.wait("STOPPING", "1", timeout=10)
        assert daemon.wait(10) == 0, daemon.output()
    finally:
        notify.close()
    assert "stopped: everything read is committed" in daemon.output()


def test_a_writer_waiting_for_the_database_keeps_pinging(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    notify = NotifySocket(f"@nanwatch-test-{uuid.uuid4().hex}")  # the abstract namespace
    daemon = start_daemon(
        write_config(tmp_path / "nw.toml", [logs]), notify, watchdog_usec=2_000_000
    )
    try:
        notify.wait("READY", "1")
        notify.wait("WATCHDOG", "1", timeout=10)
        # another writer holds the database: the next commit waits for it (busy_timeout), the
        # pass is slow but alive; systemd must not kill the service for it (WatchdogSec 2 s)
        blocker = sqlite3.connect(daemon.db, isolation_level=None, timeout=1)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with (logs / "rank0.log").open("a") as f:
                f.write(nan_line(2))
            wait_for(lambda: "database is locked" in daemon.output(), what="the commit waiting")
            notify.drain()
            pings = [m for _, m in notify.collect(2.5) if m.get("WATCHDOG") == "1"]
            assert len(pings) >= 3, notify.received[-10:]
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        wait_for(lambda: count(daemon.db) == 2, timeout=30, what="the event read while waiting")
        assert daemon.stop() == 0
    finally:
        notify.close()


def test_a_megabyte_line_never_stalls_the_loop(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    # thousands of candidate values without the iteration marker the rule needs: a pattern
    # that looked back from each one took minutes on such a line, with no ping and no SIGTERM
    (logs / "rank1.log").write_text("loss: nan " * 100_000 + "\n" + nan_line(3))
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(
        write_config(tmp_path / "nw.toml", [logs]), notify, watchdog_usec=2_000_000
    )
    try:
        notify.wait("READY", "1", timeout=60)
        wait_for(lambda: count(daemon.db) >= 2, timeout=30, what="the events around the line")
        with (logs / "rank1.log").open("a") as f:
            f.write("loss: nan " * 100_000 + "\n")
        daemon.send(signal.SIGTERM)
        notify.wait("STOPPING", "1", timeout=10)
        assert daemon.wait(15) == 0, daemon.output()
    finally:
        notify.close()


def test_metrics_wal_readers_and_no_torch(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    port = free_port()
    config = write_config(tmp_path / "nw.toml", [logs], f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(config, notify)
    try:
        notify.wait("READY", "1")
        m = scrape(port)
        assert m['nanwatch_events_total{kind="nan"}'] == 1
        assert m['nanwatch_incidents_open{kind="nan"}'] == 1
        assert m["nanwatch_files_followed"] == 1
        assert m["nanwatch_read_lines_total"] == 1
        assert m[f'nanwatch_source_lag_bytes{{source="{logs}"}}'] == 0
        assert m["nanwatch_last_scan_timestamp_seconds"] > 0
        assert m["process_resident_memory_bytes"] > 0
        # bytes written but not yet a complete line are lag
        with (logs / "rank0.log").open("a") as f:
            f.write("partial")
        wait_for(
            lambda: scrape(port)[f'nanwatch_source_lag_bytes{{source="{logs}"}}'] == 7,
            what="lag of the partial line",
        )

        # a CLI reader holding a read transaction never blocks the daemon's writes
        reader = sqlite3.connect(f"file:{daemon.db}?mode=ro", uri=True, isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM events").fetchone()[0] == 1
        with (logs / "rank0.log").open("a") as f:
            f.write("\n" + nan_line(2))
        wait_for(lambda: count(daemon.db) == 2, what="a commit while a reader holds a snapshot")
        assert reader.execute("SELECT count(*) FROM events").fetchone()[0] == 1  # its snapshot
        reader.execute("COMMIT")
        reader.close()

        # doctor, beside the running service, reads its database and finds its metrics
        out = nanwatch("doctor", "--config", str(config), "--db", str(daemon.db)).stdout
        assert "nanwatch is serving metrics there" in out and "intact, schema" in out

        # the daemon never imports torch (installed here): no torch library is mapped
        assert importlib.util.find_spec("torch") is not None
        maps = Path(f"/proc/{daemon.pid}/maps").read_text()
        assert "_sqlite3" in maps  # the check sees the extension modules the daemon loaded
        assert "torch" not in maps
        assert daemon.stop() == 0
    finally:
        notify.close()


def test_sighup_adds_a_source_and_a_broken_reload_keeps_running(
    tmp_path: Path, start_daemon: StartDaemon
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "rank0.log").write_text(nan_line(1) + ok_line(2) + ok_line(3))
    (b / "rank0.log").write_text(nan_line(7))
    port = free_port()
    metrics = f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    config = write_config(tmp_path / "nw.toml", [a], metrics)
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(config, notify, journal=True)
    try:
        notify.wait("READY", "1")
        assert scrape(port)["nanwatch_read_lines_total"] == 3

        write_config(config, [a, b], metrics)
        daemon.send(signal.SIGHUP)
        notify.wait("RELOADING", "1")
        notify.wait("READY", "1")
        wait_for(lambda: count(daemon.db) == 2, what="the new source's event")
        wait_for(lambda: scrape(port)['nanwatch_reloads_total{result="ok"}'] == 1, what="metrics")
        assert scrape(port)["nanwatch_read_lines_total"] == 4  # a's lines were not read again
        with (a / "rank0.log").open("a") as f:
            f.write(nan_line(4))
        wait_for(lambda: count(daemon.db) == 3, what="the old source still followed")

        config.write_text(config.read_text().replace("[metrics]", "poll_intervall = 2\n[metrics]"))
        daemon.send(signal.SIGHUP)
        refused = notify.wait("READY", "1")
        assert "reload refused" in refused["STATUS"]
        with (b / "rank0.log").open("a") as f:
            f.write(nan_line(8))
        wait_for(lambda: count(daemon.db) == 4, what="an event after the refused reload")
        wait_for(
            lambda: scrape(port)['nanwatch_reloads_total{result="failed"}'] == 1, what="metrics"
        )
        assert daemon.stop() == 0
    finally:
        notify.close()
    log = daemon.output()
    # journald gets each line's level as a <N> prefix: 3 is err, 4 warning, 6 info
    assert re.search(r"(?m)^<3>nanwatch.daemon: reload refused, .*'poll_intervall'", log), log
    assert "'poll_interval'" in log and str(config) in log
    assert re.search(r"(?m)^<4>nanwatch.daemon: incident 1 opened: ", log)
    assert re.search(r"(?m)^<6>nanwatch.daemon: reloaded ", log)


def test_a_misspelt_key_fails_at_start(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    config = write_config(tmp_path / "nw.toml", [logs], "[store]\nkeeep = '90d'\n")
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(config, notify)
    assert daemon.wait(60) == 78  # EX_CONFIG: not restarted in a loop
    notify.drain()  # it has exited: whatever it sent is queued already
    assert not [m for _, m in notify.received if "READY" in m]
    notify.close()
    err = daemon.output()
    assert str(config.resolve()) in err and "'keeep'" in err and "did you mean 'keep'" in err
    assert not (tmp_path / "nw.db").exists()


def test_a_taken_metrics_port_fails_at_start(
    tmp_path: Path, logs: Path, start_daemon: StartDaemon
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = write_config(
            tmp_path / "nw.toml", [logs], f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        )
        daemon = start_daemon(config)
        assert daemon.wait(60) == 78
    assert "[metrics] listen" in daemon.output() and "pick a free port" in daemon.output()


def test_a_configured_work_dir_made_after_start_is_followed(
    tmp_path: Path, start_daemon: StartDaemon
) -> None:
    """`[sources] paths` names where the job will write; the service starts first (at boot).
    The line must come through inotify, well before the 30 s safety rescan."""
    work = tmp_path / "job" / "work_dirs"
    notify = NotifySocket(str(tmp_path / "notify.sock"))
    daemon = start_daemon(write_config(tmp_path / "nw.toml", [work]), notify)
    try:
        notify.wait("READY", "1")
        (work / "20261130_101500").mkdir(parents=True)
        (work / "20261130_101500" / "20261130_101500.log").write_text(nan_line(7))
        # half the rescan's period: what arrives came through inotify
        wait_for(lambda: count(daemon.db) == 1, timeout=15, what="the event from the new folder")
        assert daemon.stop() == 0, daemon.output()
    finally:
        notify.close()
    assert "does not exist yet; it is followed once it appears" in daemon.output()
