"""Shared fixtures. Tests run in UTC, fail on leaked threads, and use real SQLite files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
NANWATCH = [sys.executable, "-m", "nanwatch"]


@pytest.fixture(autouse=True, scope="session")
def _utc() -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5

    def leaked() -> list[threading.Thread]:
        return [
            t
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(("pytest_timeout",))
        ]

    # a thread still finishing gets the rest of the deadline to end: joined, not slept on
    for t in leaked():
        t.join(max(deadline - time.monotonic(), 0.0))
    left = leaked()
    assert not left, f"threads leaked by the test: {[t.name for t in left]}"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "nanwatch.db"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # never touch the user's own database or config
    monkeypatch.setenv("NANWATCH_DB", str(tmp_path / "default.db"))
    monkeypatch.delenv("NANWATCH_CONFIG", raising=False)
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)


def nanwatch(
    *args: str, check: bool = True, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a subprocess."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [*NANWATCH, *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"nanwatch {' '.join(args)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def wait_for(
    cond: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


READY = "nanwatch.daemon: ready: "  # logged once the first pass is committed


class Watch:
    """One `nanwatch watch` process; its stdout and stderr go to ``out``."""

    def __init__(self, argv: list[str], db: Path, out: Path, **popen: Any) -> None:
        self.argv, self.db, self.out = argv, db, out
        # a restarted daemon appends to the same file: what this process wrote starts here
        self._start = out.stat().st_size if out.exists() else 0
        with out.open("ab") as f:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, **popen
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """What this process printed so far (stdout and stderr)."""
        with self.out.open("rb") as f:
            f.seek(self._start)
            return f.read().decode(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the daemon says its first pass is committed; fails at once if it exits."""
        wait_for(
            lambda: READY in self.output() or not self.running(),
            timeout=timeout,
            what=f"`{' '.join(self.argv[-4:])}` to be ready",
        )
        assert self.running(), f"watch exited {self.proc.returncode}:\n{self.output()[-3000:]}"

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.reap()
            tail = self.output()[-3000:]
            raise AssertionError(f"watch still running after {timeout}s:\n{tail}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Signal it (SIGTERM: a clean stop) and reap it; its exit status."""
        if self.running():
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> int:
        """SIGKILL, as a crash or the OOM killer would; the exit status (-9)."""
        return self.stop(signal.SIGKILL, timeout=10)

    def reap(self) -> None:
        if self.running():
            self.proc.kill()
        self.proc.wait(10)


StartWatch = Callable[..., Watch]


@pytest.fixture
def start_watch(tmp_path: Path) -> Iterator[StartWatch]:
    """``start_watch(*paths, db=..., config=..., ready=True, ...)`` runs `nanwatch watch` and
    returns its :class:`Watch`; every process started is reaped when the test ends, whatever
    happened. ``ready``: wait until the first pass is committed (off for a test that wants the
    process at an earlier instant, or one that expects it to fail at start). ``prefix`` runs it
    under another command (unshare, setpriv); ``command`` replaces ``python -m nanwatch``."""
    started: list[Watch] = []

    def start(
        *paths: str | Path,
        db: Path | None = None,
        config: Path | None = None,
        quiet: bool = True,
        verbose: int = 0,
        ready: bool = True,
        out: Path | None = None,
        prefix: Sequence[str] = (),
        command: Sequence[str] = NANWATCH,
        **popen: Any,
    ) -> Watch:
        argv = [*prefix, *command, "watch"]
        argv += ["--quiet"] * quiet + ["-v"] * verbose
        argv += ["--config", str(config)] if config is not None else []
        db = db if db is not None else tmp_path / "nw.db"
        argv += ["--db", str(db), *map(str, paths)]
        w = Watch(argv, db, out if out is not None else tmp_path / "watch.out", **popen)
        started.append(w)
        if ready:
            w.wait_ready()
        return w

    try:
        yield start
    finally:
        for w in started:
            w.reap()
