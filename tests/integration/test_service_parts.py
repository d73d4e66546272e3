"""The service's parts in-process: retention, reload of sources, secrets, notify, log redaction."""

from __future__ import annotations

import json
import logging
import random
import socket
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from nanwatch.config import Config, StoreConfig, load_config, read_secret
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.daemon.service import Notifier, setup_logging
from nanwatch.detect import load_rules
from nanwatch.errors import ConfigError
from nanwatch.events import Event, Metric, format_utc
from nanwatch.store import Store
from nanwatch.store.metrics import Metrics
from nanwatch.store.retention import Housekeeper

from ..sources.test_sources import nan_line, ok_line

DAY = 86400.0

SITE_PACK = """
[pack]
id = "site"
title = "This site's fatal lines"

[[rule]]
id = "site.fatal"
kind = "process_failure"
literals = ["SITE-FATAL"]
pattern = 'SITE-FATAL: (?P<reason>.+)'
[[rule.example]]
line = "SITE-FATAL: the fabric manager died"
event = { kind = "process_failure" }
"""


def _event(i: int) -> Event:
    return Event(kind="nan", message=f"loss is nan at {i}", offset=i * 100, rank=0, iter=i)


def _fill(store: Store, *, old: int, young: int, now: float, metrics: int = 0) -> None:
    """``old`` events ingested 100 days ago, ``young`` ones now, ``metrics`` metric rows."""
    run = store.run_id("/r", "", "r")
    store.execute(
        "INSERT INTO sources(run_id, path, root, dev, ino, created_at, updated_at) "
        "VALUES (?, '/r/rank0.log', '/r', 1, 1, ?, ?)",
        (run, format_utc(now), format_utc(now)),
    )
    with store.transaction():
        store.insert_events(run, 1, [_event(i) for i in range(old)], format_utc(now - 100 * DAY))
        store.insert_events(
            run, 1, [_event(i) for i in range(old, old + young)], format_utc(now - DAY)
        )
        store.insert_metrics(
            run,
            1,
            [
                Metric(10**6 + i, 0, i, None, i, "train", None, loss=0.5, step_time=0.1)
                for i in range(metrics)
            ],
        )


def _run_pass(hk: Housekeeper, now: float) -> None:
    assert hk.step(now) or hk._stage is None
    for _ in range(100000):
        if not hk.step(now):
            return
    raise AssertionError("retention never finished")


def test_retention_deletes_old_rows_keeps_incidents_and_shrinks_the_file(db: Path) -> None:
    now = time.time()
    store = Store.open(db)
    _fill(store, old=3000, young=5, now=now, metrics=20000)
    # an open incident holds two old events; a long-resolved one holds one
    store.execute(
        "INSERT INTO incidents(id, run_id, kind, key, title, status, created_at, updated_at) "
        "VALUES (1, 1, 'nan', 'nan', 'open one', 'open', 'x', 'x'), "
        "(2, 1, 'nan', 'nan2', 'old one', 'resolved', 'x', 'x')"
    )
    store.execute(
        "UPDATE incidents SET resolved_at = ? WHERE id = 2", (format_utc(now - 95 * DAY),)
    )
    store.execute("UPDATE events SET incident_id = 1 WHERE id IN (1, 2)")
    store.execute("UPDATE events SET incident_id = 2 WHERE id = 3")
    # metric blocks are aged by marks: all 20000 iterations existed 100 days ago
    store.add_metric_mark(now - 100 * DAY, keep=90 * DAY)
    size_before = db.stat().st_size + Path(f"{db}-wal").stat().st_size
    store.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    file_before = db.stat().st_size

    # a CLI reader holds a read transaction through the whole pass: it blocks nothing
    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM events").fetchone()[0] == 3005

    hk = Housekeeper(store, StoreConfig(keep=90 * DAY))
    _run_pass(hk, now)
    assert reader.execute("SELECT count(*) FROM events").fetchone()[0] == 3005  # its snapshot
    reader.execute("COMMIT")
    reader.close()

    kept = [r[0] for r in store._conn.execute("SELECT id FROM events ORDER BY id")]
    assert kept == [1, 2, 3001, 3002, 3003, 3004, 3005]
    assert store._conn.execute("SELECT id FROM incidents").fetchall() == [(1,)]
    assert Metrics(store).count() == 0
    assert hk.deleted == {"events": 2998, "incidents": 1, "metrics": 20000}
    store.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert store._conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert db.stat().st_size < file_before / 2, (size_before, file_before, db.stat().st_size)
    store.close()


def test_retention_keeps_young_metrics_and_everything_without_keep(db: Path) -> None:
    now = time.time()
    store = Store.open(db)
    _fill(store, old=10, young=0, now=now, metrics=100)
    hk = Housekeeper(store, StoreConfig())
    assert not hk.step(now)
    assert store._conn.execute("SELECT count(*) FROM events").fetchone()[0] == 10
    # marks begin when retention is switched on: rows are never aged before a mark says so
    hk = Housekeeper(store, StoreConfig(keep=90 * DAY))
    _run_pass(hk, now)
    assert Metrics(store).count() == 100
    assert store._conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    marks = json.loads(store.meta_get("retention_marks") or "[]")
    assert marks == [[pytest.approx(now), 1]]  # the highest metric block then
    store.close()


def test_max_size_trims_oldest_metrics_then_events(db: Path) -> None:
    now = time.time()
    store = Store.open(db)
    _fill(store, old=0, young=4000, now=now, metrics=0)
    # numbers that do not compress, so that the metrics outweigh the events (as they do)
    rng = random.Random(1)
    with store.transaction():
        store.insert_metrics(
            1,
            1,
            [
                Metric(i, 0, i, None, i, "train", None, loss=rng.random(), step_time=rng.random())
                for i in range(100000)
            ],
        )
    used = store.size_info()["used"]
    # the cap leaves the events (with their full-text index) well under it once metrics went
    hk = Housekeeper(store, StoreConfig(max_size=used // 2))
    _run_pass(hk, now)
    assert store.size_info()["used"] <= used // 2
    assert Metrics(store).count() == 0
    left = [r[0] for r in store._conn.execute("SELECT id FROM events ORDER BY id")]
    assert left and left == list(range(4001 - len(left), 4001))  # the newest stay
    store.close()


def test_reconfigure_keeps_offsets_and_swaps_rules(tmp_path: Path, db: Path) -> None:
    runs = tmp_path / "runs"
    a, b = runs / "a", runs / "b"
    a.mkdir(parents=True)
    b.mkdir()
    (a / "rank0.log").write_text(nan_line(1) + ok_line(2))
    (b / "rank0.log").write_text(nan_line(3))
    store = Store.open(db)
    pipe = Pipeline(Config(), store, [str(a)], live=True)
    try:
        pipe.step()
        assert pipe.stats.lines == 2
        pipe.reconfigure(Config(), [str(a), str(b)])
        pipe.step()
        assert pipe.stats.lines == 3  # b only
        pipe.reconfigure(Config(), [str(b)])
        assert [r.path for r in pipe.tracker.records.values()] == [str(b / "rank0.log")]
        with (a / "rank0.log").open("a") as f:
            f.write(nan_line(4))
        pipe.step()
        assert pipe.stats.lines == 3  # a is not followed now
        # a's parent as a source: a's file comes back at its stored offset
        pipe.reconfigure(Config(), [str(runs)])
        pipe.step()
        assert pipe.stats.lines == 4
        rows = store._conn.execute("SELECT iter FROM events ORDER BY iter").fetchall()
        assert rows == [(1,), (3,), (4,)]
        # new rules apply from the next line on
        site = tmp_path / "site"
        site.mkdir()
        (site / "site.toml").write_text(SITE_PACK)
        pipe.reconfigure(Config(), [str(runs)], rules=load_rules([site]))
        with (b / "rank0.log").open("a") as f:
            f.write("SITE-FATAL: the fabric manager died\n")
        pipe.step()
        kinds = store._conn.execute("SELECT kind FROM events ORDER BY id").fetchall()
        assert kinds[-1] == ("process_failure",) and len(kinds) == 4
    finally:
        pipe.tracker.close()
        store.close()


def test_read_secret_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "slack-token").write_text("\n")  # the unit's empty default
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    monkeypatch.setenv("SLACK_BOT_TOKEN", "from-env")
    args = {"credential": "slack-token", "env": "SLACK_BOT_TOKEN", "key": "[slack] token_file"}
    assert read_secret(file=None, **args) == "from-env"
    (creds / "slack-token").write_text("from-credential\n")
    assert read_secret(file=None, **args) == "from-credential"
    f = tmp_path / "token"
    f.write_text(" from-file \n")
    f.chmod(0o600)  # a secret file is owner-only
    assert read_secret(file=str(f), **args) == "from-file"
    with pytest.raises(ConfigError, match=r"token_file = .*no such file"):
        read_secret(file=str(tmp_path / "missing"), **args)
    f.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        read_secret(file=str(f), **args)


def test_service_keys_in_config(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[store]\nkeep = "90d"\nmax_size = "2GiB"\n')
    assert load_config(p).store == StoreConfig(keep=90 * DAY, max_size=2 << 30)
    p.write_text('[store]\nmax_size = "lots"\n')
    with pytest.raises(ConfigError, match=r"\[store\] max_size: expected a size"):
        load_config(p)
    p.write_text('[metrics]\nlisten = "9464"\n')
    with pytest.raises(ConfigError, match=r"\[metrics\] listen = '9464': expected host:port"):
        load_config(p)
    p.write_text('[metrics]\nlisten = "[::1]:9464"\n')
    assert load_config(p).metrics.listen == "[::1]:9464"


def test_notifier_addresses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0nanwatch-notifier-test")
    sock.settimeout(5)
    try:
        n = Notifier.from_environ(
            {"NOTIFY_SOCKET": "@nanwatch-notifier-test", "WATCHDOG_USEC": "10000000"}
        )
        assert n.watchdog_interval == 5.0
        assert n.send("READY=1", "STATUS=ok")
        assert sock.recv(100) == b"READY=1\nSTATUS=ok"
        n.close()
    finally:
        sock.close()
    # a listener that stops reading fills its queue: sends fail, they never block the loop
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deaf.bind("\0nanwatch-notifier-deaf")
    try:
        n = Notifier("@nanwatch-notifier-deaf")
        sent = [n.send(f"STATUS={i}") for i in range(5000)]
        assert sent[0] and not sent[-1]
        n.close()
    finally:
        deaf.close()
    # the watchdog of another process (WATCHDOG_PID) is not ours; no socket: no-op
    other = Notifier.from_environ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None and not other.send("READY=1")


def test_secrets_never_reach_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        setup_logging(0)
        logging.getLogger("nanwatch.test").warning(
            "posting with %s to %s",
            "xoxb-1234-5678-abcdef",
            "https://hooks.slack.com/services/T/B/x",
        )
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)
    err = capsys.readouterr().err
    assert "WARNING nanwatch.test: posting with <redacted> to https://<redacted>" in err
    assert "xoxb" not in err and "hooks.slack.com" not in err


def test_an_idle_connection_never_holds_back_a_scrape(db: Path) -> None:
    from nanwatch.daemon.prometheus import NanwatchCollector, serve

    Store.open(db).close()
    collector = NanwatchCollector(db)
    server = serve("127.0.0.1:0", collector, where="[metrics] listen")
    idle = socket.create_connection(("127.0.0.1", server.port))
    try:
        # a scraper (or a port scanner) that connected and said nothing: the next scrape
        # is answered anyway, well within Prometheus' scrape timeout
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")
        with urllib.request.urlopen(server.url, timeout=3) as resp:
            assert b"nanwatch_info" in resp.read()
    finally:
        idle.close()
        server.stop()
        collector.close()


def test_the_watchdog_pings_while_the_loop_lives_and_stops_when_it_is_wedged(
    tmp_path: Path,
) -> None:
    from nanwatch.daemon.service import Watchdog

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(5)
    notifier = Notifier(str(tmp_path / "notify.sock"))
    now = [1000.0]
    dog = Watchdog(notifier, every=0.01, liveness=300.0, clock=lambda: now[0])
    try:
        assert dog.tick() and listener.recv(100) == b"WATCHDOG=1"
        now[0] += 299.0  # a long pass, no commit yet: still alive
        assert dog.tick() and listener.recv(100) == b"WATCHDOG=1"
        now[0] += 2.0  # nothing for longer than the bound: wedged, systemd may restart it
        assert not dog.tick()
        dog.beat()  # the loop moved again
        assert dog.tick() and listener.recv(100) == b"WATCHDOG=1"
        # the thread pings by itself, whatever the caller's thread is doing
        dog.start()
        assert listener.recv(100) == b"WATCHDOG=1"
        dog.stop()
    finally:
        dog.stop()
        notifier.close()
        listener.close()
