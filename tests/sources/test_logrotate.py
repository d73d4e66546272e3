"""Real logrotate (create, then copytruncate) and real SIGKILLs while a writer appends."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ..conftest import StartWatch, wait_for
from ..integration.test_kill import caught_up
from ..sources.test_sources import nan_line

pytestmark = pytest.mark.slow
LOGROTATE = shutil.which("logrotate") or (
    "/usr/sbin/logrotate" if Path("/usr/sbin/logrotate").exists() else None
)


class Writer(threading.Thread):
    """Appends one NaN line per iteration to each rank log; can pause and reopen its files."""

    def __init__(self, logs: Path, ranks: int, iterations: int) -> None:
        super().__init__(name="rank-writer")
        self.logs, self.ranks, self.iterations = logs, ranks, iterations
        self.done_upto = 0
        self.go = threading.Event()
        self.go.set()
        self.paused = threading.Event()
        self.reopen = threading.Event()
        self.error: BaseException | None = None

    def _open(self) -> list[object]:
        return [open(self.logs / f"rank{r}.log", "a", buffering=1) for r in range(self.ranks)]

    def run(self) -> None:
        handles = self._open()
        try:
            for i in range(1, self.iterations + 1):
                if not self.go.is_set():
                    self.paused.set()
                    self.go.wait()
                    self.paused.clear()
                if self.reopen.is_set():  # what an application does on logrotate's postrotate
                    for h in handles:
                        h.close()  # type: ignore[attr-defined]
                    handles = self._open()
                    self.reopen.clear()
                for h in handles:
                    h.write(nan_line(i))  # type: ignore[attr-defined]
                self.done_upto = i
                # paces it like a training loop so rotations and kills come while it writes;
                # they are placed by iteration (until()), no assertion depends on this duration
                time.sleep(0.01)
        except BaseException as e:  # pragma: no cover - reported by the test
            self.error = e
        finally:
            for h in handles:
                h.close()  # type: ignore[attr-defined]


def rotate(logs: Path, tmp: Path, mode: str) -> None:
    conf = tmp / f"logrotate-{mode}.conf"
    conf.write_text(
        f"{logs}/rank*.log {{\n  rotate 5\n  {mode}\n  missingok\n  nocompress\n  notifempty\n}}\n"
    )
    subprocess.run(
        [LOGROTATE, "-f", "-s", str(tmp / "logrotate.state"), str(conf)],
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.mark.skipif(LOGROTATE is None, reason="logrotate is not installed (make sysdeps)")
def test_logrotate_and_sigkills_lose_and_duplicate_nothing(
    tmp_path: Path, start_watch: StartWatch
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    db = tmp_path / "nw.db"
    out = tmp_path / "watch.out"
    ranks, iterations = 3, 200
    writer = Writer(logs, ranks, iterations)
    watch = start_watch(logs, db=db, out=out, ready=False)
    writer.start()

    def kill_and_restart() -> None:
        nonlocal watch
        assert watch.kill() == -signal.SIGKILL
        watch = start_watch(logs, db=db, out=out, ready=False)

    def until(i: int) -> None:
        wait_for(lambda: writer.done_upto >= i, timeout=60, what=f"iteration {i}")

    try:
        until(40)
        kill_and_restart()
        until(70)
        rotate(logs, tmp_path, "create")  # rename rank*.log -> .1, create new files
        writer.reopen.set()
        until(100)
        kill_and_restart()
        until(130)
        writer.go.clear()  # pause the writer during the copy
        wait_for(writer.paused.is_set, timeout=30, what="the writer to pause")
        rotate(logs, tmp_path, "copytruncate")
        writer.go.set()
        until(160)
        kill_and_restart()
        writer.join(60)
        assert writer.error is None and writer.done_upto == iterations
        # every byte of every file (rotated ones included) committed: nothing more can come
        wait_for(lambda: caught_up(db, logs), timeout=60, what="every byte committed")
        assert watch.stop() == 0, watch.output()[-2000:]
    finally:
        writer.go.set()
        writer.join(60)
    assert sorted(p.name for p in logs.iterdir())[:3] == ["rank0.log", "rank0.log.1", "rank0.log.2"]
    conn = sqlite3.connect(db)
    rows = conn.execute(
        "SELECT e.rank, e.iter, count(*) FROM events e GROUP BY e.rank, e.iter"
    ).fetchall()
    conn.close()
    seen = {(r, i): n for r, i, n in rows}
    want = {(r, i) for r in range(ranks) for i in range(1, iterations + 1)}
    assert set(seen) == want, f"missing {sorted(want - set(seen))[:10]}"
    assert all(n == 1 for n in seen.values()), ({k: n for k, n in seen.items() if n > 1}, str(db))
    assert sum(seen.values()) == 600
