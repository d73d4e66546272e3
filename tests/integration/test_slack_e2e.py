"""Slack end to end: `nanwatch watch` / `scan --notify` as real processes, a real HTTP server.

These are the acceptance checks: a NaN storm gives one parent message (429 honoured, token
sent, log text escaped); `scan --notify` posts one parent per incident; an outage with a
restart of nanwatch in the middle delivers every incident's message exactly once.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nanwatch.demo.simulate import TrainingRun

from ..conftest import NANWATCH, nanwatch, wait_for
from ..slack_server import TOKEN, SlackServer
from ..sources.test_sources import nan_line
from .test_daemon import NotifySocket

pytestmark = pytest.mark.slow

MENTIONS = " <!channel> <!here> <@U024BE7LH> <https://evil.example/x|click>"
RAW = ("<!channel>", "<!here>", "<@U024BE7LH>", "<https://evil")


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    with SlackServer() as srv:
        yield srv


def config(tmp: Path, srv: SlackServer, **alerts: str) -> Path:
    token = tmp / "slack-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    timers = {"group_wait": "1s", "group_interval": "2s", **alerts}
    cfg = tmp / "nanwatch.toml"
    cfg.write_text(
        f'[slack]\nchannel = "#training-alerts"\ntoken_file = "{token}"\n'
        f'base_url = "{srv.base_url}"\n[alerts]\n'
        + "".join(f'{k} = "{v}"\n' for k, v in timers.items())
    )
    return cfg


class Watch:
    """`nanwatch watch` as a service: ``ready()`` returns once it has caught up with its files
    (systemd's READY=1 on a notify socket of the test's own)."""

    def __init__(self, cfg: Path, db: Path, path: Path, log: Path) -> None:
        self.notify = NotifySocket(f"@nanwatch-test-{uuid.uuid4().hex}")
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        env["NOTIFY_SOCKET"] = self.notify.address
        out = log.open("ab")
        try:
            self.proc = subprocess.Popen(
                [*NANWATCH, "watch", "--quiet", "--config", str(cfg), "--db", str(db), str(path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        finally:
            out.close()
        self.log = log

    def ready(self) -> None:
        self.notify.wait("READY", "1", timeout=60)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.notify.close()
        assert code == 0, self.log.read_text()


def read_up_to(db: Path, log: Path) -> bool:
    """Whether the store's offset for ``log`` is at its end, and every event is in an incident
    (what was written has been read, correlated and queued)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        (offset,) = conn.execute(
            "SELECT coalesce(max(offset), -1) FROM sources WHERE path LIKE ?", (f"%/{log.name}",)
        ).fetchone()
        (loose,) = conn.execute("SELECT count(*) FROM events WHERE incident_id IS NULL").fetchone()
    except sqlite3.Error:
        return False
    finally:
        conn.close()
    return bool(offset == log.stat().st_size and loose == 0)


def delivered(db: Path) -> bool:
    rows = outbox(db)
    return bool(rows) and all(r[3] for r in rows)


def outbox(db: Path) -> list[tuple[int, str, int, str | None, str | None]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return list(
            conn.execute(
                "SELECT incident_id, action, attempts, delivered_at, last_error FROM outbox"
            )
        )
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def paced(srv: SlackServer) -> bool:
    """About one call per second to the channel (all tests post to one channel)."""
    gated = ("chat.postMessage", "chat.update", "files.getUploadURLExternal")
    times = sorted(c.at for c in srv.calls if c.method in gated)
    return all(b - a >= 0.9 for a, b in itertools.pairwise(times))


def sent_text(srv: SlackServer) -> str:
    with srv.lock:
        return "\n".join(json.dumps(c.params, ensure_ascii=False) for c in srv.calls)


def test_watch_nan_storm_one_parent_429_token_escaped(slack: SlackServer, tmp_path: Path) -> None:
    slack.fail("chat.postMessage", status=429, retry_after=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "train.log"
    log.write_text("".join(nan_line(i).replace("loss: nan", "loss: 0.5") for i in range(1, 6)))
    db = tmp_path / "nw.db"
    watch = Watch(config(tmp_path, slack), db, logs, tmp_path / "watch.out")
    try:
        watch.ready()  # it has settled on the healthy lines
        with log.open("a", encoding="utf-8") as f:  # 16 NaN lines, read in 4 bursts
            for burst in range(4):
                for i in range(6 + 4 * burst, 10 + 4 * burst):
                    f.write(nan_line(i).rstrip("\n") + MENTIONS + "\n")
                f.flush()
                wait_for(lambda: read_up_to(db, log), what=f"burst {burst} read")
        wait_for(lambda: len(slack.parents()) == 1, timeout=30, what="the parent message")
        # every line read and every change delivered: nothing is left that could be sent
        wait_for(lambda: read_up_to(db, log) and delivered(db), timeout=30, what="empty outbox")
    finally:
        watch.stop()
    assert len(slack.parents()) == 1
    posts = slack.calls_to("chat.postMessage")
    assert posts[0].status == 429 and posts[1].status == 200
    assert posts[1].at - posts[0].at >= 3  # not before Retry-After
    assert len(posts) - 2 + len(slack.calls_to("chat.update")) <= 3  # a few follow-ups at most
    assert all(
        c.headers.get("Authorization") == f"Bearer {TOKEN}"
        for c in slack.calls
        if not c.method.startswith("upload/")
    )
    text = sent_text(slack)
    assert "&lt;!channel&gt;" in text  # the log line did reach Slack, escaped
    for raw in RAW:
        assert raw not in text
    assert TOKEN not in watch.log.read_text()


def test_scan_notify_posts_one_parent_per_incident(slack: SlackServer, tmp_path: Path) -> None:
    wd = tmp_path / "work_dirs" / "dino"
    TrainingRun(wd, timestamp="20261130_101500", ranks=4, nan_rank=1).write()
    TrainingRun(wd, timestamp="20261201_090000", ranks=4, nan_rank=3).write()
    TrainingRun(wd, timestamp="20261202_080000", ranks=2, nan_rank=0).write()
    oom = wd / "20261202_080000" / "rank1.log"
    with oom.open("a") as f:
        f.write(
            "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 1; 79.11 GiB "
            "total capacity; 70.00 GiB already allocated; 1.00 GiB free; 76.00 GiB reserved in "
            "total by PyTorch)\n"
        )
    db = tmp_path / "nw.db"
    # a group_wait of an hour: scan --notify does not wait for it
    cfg = config(tmp_path, slack, group_wait="1h")
    out = nanwatch("scan", "--notify", "--json", "--config", str(cfg), "--db", str(db), str(wd))
    summary = json.loads(out.stdout)
    incidents = summary["incidents"]
    assert len(incidents) == 4 and summary["undelivered"] == 0
    parents = slack.parents()
    assert sorted(p.text.split(" ")[1] for p in parents) == sorted(f"#{i['id']}" for i in incidents)
    assert paced(slack)  # the per-channel budget
    # scanning again finds nothing new and posts nothing
    nanwatch("scan", "--notify", "--config", str(cfg), "--db", str(db), str(wd))
    assert len(slack.parents()) == 4


def test_outage_and_restart_deliver_every_message_exactly_once(
    slack: SlackServer, tmp_path: Path
) -> None:
    wd = tmp_path / "work_dirs" / "dino"
    a = TrainingRun(wd, timestamp="20261130_101500", ranks=2, nan_rank=1)
    a.write()
    db = tmp_path / "nw.db"
    cfg = config(tmp_path, slack, group_interval="1s")
    out = tmp_path / "watch.out"
    watch = Watch(cfg, db, wd, out)
    try:
        wait_for(lambda: len(slack.parents()) == 1, timeout=30, what="incident A's message")
        (parent_a,) = slack.parents()
        slack.stop()  # Slack goes away
        # meanwhile: incident A spreads to a new rank, and run B goes wrong
        (a.launch_dir / "rank2.log").write_text(nan_line(1))
        TrainingRun(wd, timestamp="20261201_090000", ranks=2, nan_rank=0).write()
        wait_for(
            lambda: sum(1 for r in outbox(db) if r[2] >= 1 and not r[3]) >= 2,
            timeout=30,
            what="failed delivery attempts during the outage",
        )
        watch.stop()  # nanwatch restarts while Slack is still down
        watch = Watch(cfg, db, wd, out)
        watch.ready()
        slack.start()  # Slack is back, on the same address
        wait_for(
            lambda: len(slack.parents()) == 2 and bool(slack.replies(parent_a.ts)),
            timeout=60,
            what="the held messages",
        )
        wait_for(lambda: delivered(db), timeout=30, what="an empty outbox")
    finally:
        watch.stop()
    parents = slack.parents()
    assert len(parents) == 2  # A once (edited, not re-posted), B once
    assert [p.ts for p in parents].count(parent_a.ts) == 1
    assert any("ranks 2 affected" in r.text for r in slack.replies(parent_a.ts))
    assert parent_a.edits and "0-2" in json.dumps(parent_a.edits[-1]["blocks"])
    (b,) = [p for p in parents if p.ts != parent_a.ts]
    assert "20261201_090000" in b.text
    assert paced(slack)  # also right after the restart
    log = out.read_text()
    assert "cannot reach Slack" in log and TOKEN not in log


@pytest.mark.parametrize(
    ("broken", "timeout"), [("files.getUploadURLExternal", None), ("upload", "5")]
)
def test_scan_notify_with_failing_plot_uploads_delivers_and_returns(
    slack: SlackServer, tmp_path: Path, broken: str, timeout: str | None
) -> None:
    wd = tmp_path / "work_dirs" / "dino"
    TrainingRun(wd, timestamp="20261130_101500", ranks=2, nan_rank=1).write()
    # every file upload fails (the API method, or the upload URL it hands out); messages work
    if broken == "upload":
        for n in range(1, 30):
            slack.fail(f"upload/F{n:08d}", status=500, error="internal_error")
    else:
        slack.fail(broken, status=500, error="internal_error", times=100)
    db = tmp_path / "nw.db"
    cfg = config(tmp_path, slack)
    started = time.monotonic()
    args = ["--notify-timeout", timeout] if timeout else []
    proc = nanwatch(
        "scan", "--notify", *args, "--json", "--config", str(cfg), "--db", str(db), str(wd)
    )
    took = time.monotonic() - started
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert len(slack.parents()) == len(summary["incidents"]) == 1
    # the plot is best-effort: tried a few times, never blamed on Slack being unreachable
    assert 1 <= len(slack.calls_to("files.getUploadURLExternal")) <= 5
    assert "cannot reach Slack" not in proc.stderr, proc.stderr
    if timeout is None:
        # five attempts (2+4+8+16 s apart), then given up, well within the 60 s default
        assert took < 60 and summary["undelivered"] == 0
        assert len(slack.calls_to("files.getUploadURLExternal")) == 5
        assert "given up" in proc.stderr
    else:
        # what --notify-timeout cut short stays queued for the daemon, and the command says so
        assert took < 30 and summary["undelivered"] == 1
        assert "left in the outbox" in proc.stderr
        assert [r[1] for r in outbox(db) if r[3] is None] == ["plot"]
