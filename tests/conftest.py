"""Shared fixtures. Tests run in UTC, fail on leaked threads, and use real SQLite files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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
    while True:
        leaked = [
            t
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(("pytest_timeout",))
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"threads leaked by the test: {[t.name for t in leaked]}"


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
