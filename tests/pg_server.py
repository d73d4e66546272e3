"""A real PostgreSQL server for the tests: Debian's binaries, a temporary data directory, loopback.

``initdb`` refuses to run as root, so when the tests run as root the cluster belongs to an
unprivileged account (``nobody``) and every server command runs as it. The superuser has a
password (scram on TCP), so the tests go through the same password path operators use: a
password file or ``PGPASSWORD``, never the DSN on a command line.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

USER = "nanwatch"
PASSWORD = "fleet-test-secret"


def bindir() -> Path | None:
    """Where initdb and pg_ctl live, or None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name or 0),
    )
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    """Start with ``start()``, stop with ``stop()``; ``dsn(db)`` names a database on it."""

    def __init__(self) -> None:
        bins = bindir()
        if bins is None:
            raise FileNotFoundError("PostgreSQL is not installed (make sysdeps installs it)")
        self.bin = bins
        self.port = _free_port()
        # /tmp, not pytest's tmp_path: the server account must be able to reach the directory
        self.base = Path(tempfile.mkdtemp(prefix="nanwatch-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self._as: dict[str, object] = {}
        if os.geteuid() == 0:
            who = pwd.getpwnam("nobody")
            os.chown(self.base, who.pw_uid, who.pw_gid)
            self._as = {"user": who.pw_uid, "group": who.pw_gid}
        self.running = False

    def _run(self, *args: str) -> None:
        proc = subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.base,
            env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
            **self._as,  # type: ignore[arg-type]
        )
        if proc.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {proc.stderr}{proc.stdout}\n{log}")

    def start(self) -> PgServer:
        pwfile = self.base / "pw"
        pwfile.write_text(PASSWORD + "\n")
        if self._as:
            os.chown(pwfile, int(self._as["user"]), int(self._as["group"]))  # type: ignore[call-overload]
        self._run(
            "initdb", "-D", str(self.data), "-U", USER, f"--pwfile={pwfile}",
            "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
        )  # fmt: skip
        pwfile.unlink()
        opts = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")
        self.running = True
        return self

    def stop(self) -> None:
        if self.running:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            self.running = False

    def restart(self) -> None:
        opts = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "start")
        self.running = True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def dsn(self, database: str = "postgres") -> str:
        """A DSN without the password (that comes from PGPASSWORD or a password file)."""
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.dsn(), password=PASSWORD, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)
