"""Live latency of a running `nanwatch watch`: a line appended -> its event committed, and an
incident's first line -> the Slack request (after ``group_wait``).

Eight rank logs get healthy mmengine iteration lines in the background; probe lines (a NaN
loss on a random rank) are appended one write(2) each, and their time is taken just before
the write. The event's ``ingested_at`` (the daemon's clock, milliseconds) minus that time is the
latency. Slack is the loopback server of the test suite (tests/slack_server.py).
"""

from __future__ import annotations

import datetime as dt
import random
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

from nanwatch.demo.simulate import TrainingRun, mmengine_iter_line, npu_oom_traceback
from nanwatch.events import parse_utc

from .common import median, percentile
from .daemon import Daemon

TOKEN = "xoxb-bench-0123456789"


def _line(rank: int, it: int, *, nan: bool) -> bytes:
    now = dt.datetime(2026, 11, 30, 12, 0, 0) + dt.timedelta(seconds=it)
    loss = float("nan") if nan else 0.5 + rank / 100
    text = mmengine_iter_line(
        now,
        "train",
        1,
        it,
        10**6,
        step_time=0.86,
        grad_norm=float("nan") if nan else 12.5,
        losses={"loss": loss, "loss_cls": loss, "loss_bbox": 0.31},
    )
    return (text + "\n").encode()


def _events(db: Path, kind: str) -> list[tuple[str, int, str]]:
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return []
    try:
        return conn.execute(
            "SELECT s.path, e.offset, e.ingested_at FROM events e JOIN sources s "
            "ON s.id = e.source_id WHERE e.kind = ?",
            (kind,),
        ).fetchall()
    except sqlite3.Error:
        return []
    finally:
        conn.close()


def latency(
    mode: str, *, probes: int, gap: float, poll_interval: float = 2.0, bg_rate: float = 10.0
) -> dict[str, Any]:
    """``probes`` NaN lines ``gap`` s apart on 8 busy rank logs; seconds to their commit."""
    tmp = Path(tempfile.mkdtemp(prefix="nanwatch-bench-live-"))
    try:
        run = TrainingRun(tmp / "job" / "dino", ranks=8, epochs=1, iters=50, nan_at=None)
        files = run.write()
        cfg = tmp / "nanwatch.toml"
        cfg.write_text(
            f'[sources]\npaths = ["{tmp / "job"}"]\nmode = "{mode}"\n'
            f"poll_interval = {poll_interval}\n"
        )
        db = tmp / "nw.db"
        rng = random.Random(7)
        handles = [f.open("ab", buffering=0) for f in files]
        it = [1000] * len(files)
        written: dict[tuple[str, int], float] = {}
        try:
            with Daemon(cfg, db, tmp):
                time.sleep(1.0)
                t_next_bg = time.monotonic()
                t_next_probe = time.monotonic() + gap
                while len(written) < probes:
                    now = time.monotonic()
                    if now >= t_next_bg:
                        for r, h in enumerate(handles):
                            it[r] += 1
                            h.write(_line(r, it[r], nan=False))
                        t_next_bg += 1.0 / bg_rate
                    if now >= t_next_probe:
                        r = rng.randrange(len(files))
                        it[r] += 1
                        data = _line(r, it[r], nan=True)
                        offset = handles[r].tell()
                        # taken before the write: the daemon may commit before write() returns
                        t = time.time()
                        handles[r].write(data)
                        written[(str(files[r]), offset)] = t
                        t_next_probe += gap * rng.uniform(0.5, 1.5)
                    time.sleep(max(0.0, min(t_next_bg, t_next_probe) - time.monotonic()))
                deadline = time.monotonic() + 30
                got: dict[tuple[str, int], str] = {}
                while time.monotonic() < deadline:
                    got = {(p, o): at for p, o, at in _events(db, "nan")}
                    if all(k in got for k in written):
                        break
                    time.sleep(0.1)
        finally:
            for h in handles:
                h.close()
        lat = [parse_utc(got[k]) - t for k, t in written.items() if k in got]
        return {
            "mode": mode,
            "poll_interval_s": poll_interval if mode == "poll" else None,
            "probes": probes,
            "committed": len(lat),
            "p50_ms": round(1000 * median(lat), 1),
            "p99_ms": round(1000 * percentile(lat, 99), 1),
            "max_ms": round(1000 * max(lat), 1),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def slack(trials: int, group_wait: float = 1.0) -> dict[str, Any]:
    """A new incident's first line -> chat.postMessage on the loopback Slack, minus group_wait."""
    from tests.slack_server import SlackServer

    tmp = Path(tempfile.mkdtemp(prefix="nanwatch-bench-slack-"))
    out: list[float] = []
    try:
        job = tmp / "job" / "dino"
        job.mkdir(parents=True)
        with SlackServer(token=TOKEN) as srv:
            token = tmp / "slack-token"
            token.write_text(TOKEN + "\n")
            token.chmod(0o600)
            cfg = tmp / "nanwatch.toml"
            cfg.write_text(
                f'[sources]\npaths = ["{tmp / "job"}"]\n'
                f'[slack]\nchannel = "#training-alerts"\ntoken_file = "{token}"\n'
                f'base_url = "{srv.base_url}"\n[alerts]\ngroup_wait = "{group_wait}s"\n'
            )
            with Daemon(cfg, tmp / "nw.db", tmp):
                time.sleep(1.0)
                for i in range(trials):
                    before = len(srv.calls_to("chat.postMessage"))
                    # a new launch (its own run): its rank 3 runs out of memory
                    launch = job / f"20261201_09{i:02d}00"
                    launch.mkdir()
                    text = "".join(x + "\n" for x in npu_oom_traceback(3))
                    t0 = time.monotonic()  # before the write, as above
                    (launch / "rank3.log").write_text(text)
                    deadline = t0 + 30 + group_wait
                    while time.monotonic() < deadline:
                        calls = srv.calls_to("chat.postMessage")
                        if len(calls) > before:
                            out.append(calls[before].at - t0 - group_wait)
                            break
                        time.sleep(0.01)
                    time.sleep(0.5)
        return {
            "trials": trials,
            "posted": len(out),
            "group_wait_s": group_wait,
            "p50_ms": round(1000 * median(out), 1) if out else None,
            "max_ms": round(1000 * max(out), 1) if out else None,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
