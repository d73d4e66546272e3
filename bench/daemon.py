"""`nanwatch watch` as a real process, started the way systemd starts it (READY=1 on a notify
socket of its own), for the live sections of the benchmark."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from .common import NANWATCH


class Daemon:
    """``with Daemon(config, db, base) as d:`` ... ``d.pid``; SIGTERM and wait on exit."""

    def __init__(
        self,
        config: Path,
        db: Path,
        base: Path,
        *,
        env: dict[str, str] | None = None,
        watchdog_usec: int | None = None,
    ) -> None:
        self.config = config
        self.db = db
        self.base = base
        self.env = dict(env or {})
        if watchdog_usec:
            # the unit's WatchdogSec: the service pings (and ticks) every half of it
            self.env["WATCHDOG_USEC"] = str(watchdog_usec)
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.ready_after = 0.0

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Daemon:
        path = self.base / f"notify-{os.getpid()}-{time.monotonic_ns()}.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(300)
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(path)}
        cmd = [*NANWATCH, "watch", "--quiet", "--config", str(self.config), "--db", str(self.db)]
        self.err = (self.base / "daemon.err").open("ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.err, stderr=self.err)
        try:
            while b"READY=1" not in self.sock.recv(4096):
                pass
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.ready_after = time.monotonic() - t0
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close()
        self.err.close()
        if self.proc is not None and self.proc.returncode not in (0, -signal.SIGTERM):
            text = (self.base / "daemon.err").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"nanwatch watch exited {self.proc.returncode}:\n{text}")
