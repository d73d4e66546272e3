"""`nanwatch doctor`: real files, a real database, a real HTTP server speaking auth.test."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.cli._doctor_node import inotify_verdict
from nanwatch.store import SCHEMA_VERSION, Store

from ..conftest import nanwatch
from ..sources.test_sources import nan_line

GOOD = "xoxb-good-token-1234"


class _Slack(BaseHTTPRequestHandler):
    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        auth = self.headers.get("Authorization", "")
        self.seen.append(self.path)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/api/auth.test" and auth == f"Bearer {GOOD}":
            body = {"ok": True, "user": "nanwatch", "team": "ml-infra"}
        else:
            body = {"ok": False, "error": "invalid_auth"}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def slack() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Slack)
    t = threading.Thread(
        target=server.serve_forever, name="slack-stub", kwargs={"poll_interval": 0.1}
    )
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api/"
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    logs = tmp_path / "logs" / "job1"
    logs.mkdir(parents=True)
    (logs / "rank0.log").write_text(nan_line(1))
    return tmp_path


def config(node: Path, extra: str = "") -> Path:
    p = node / "nanwatch.toml"
    p.write_text(f'db = "state/nw.db"\n[sources]\npaths = ["{node / "logs"}"]\n{extra}')
    return p


def doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["doctor", *args])
    return result.exit_code, result.output


def test_a_ready_node(node: Path) -> None:
    code, out = doctor("--config", str(config(node)))
    assert code == 0, out
    assert "ok    config" in out and "1 file(s) in 2 folder(s), all readable" in out
    assert "ok    inotify     2 folder(s) to watch" in out
    assert f"{node / 'state' / 'nw.db'}: not created yet" in out
    assert "skip  slack       no [slack] section" in out
    assert out.rstrip().endswith("ready: 0 problem(s), 0 warning(s)")


def test_problems_fail_with_fixes_in_json(node: Path) -> None:
    cfg = config(node, "[sources]\n")  # a duplicate section: not TOML
    code, out = doctor("--config", str(cfg), "--json")
    assert code == 1
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (
        row["check"] == "config" and row["status"] == "fail" and "not valid TOML" in row["message"]
    )

    cfg = config(node)
    Store.open(node / "state" / "nw.db").close()
    (node / "state" / "nw.db").write_bytes(b"SQLite format 3\x00" + b"\xff" * 4000)
    code, out = doctor("--config", str(cfg), "--json")
    assert code == 1
    rows = [json.loads(line) for line in out.splitlines()]
    assert all(set(r) == {"check", "status", "message", "fix"} for r in rows)
    (bad,) = [r for r in rows if r["status"] == "fail"]
    assert bad["check"] == "database" and ".recover" in bad["fix"]


def test_database_health(node: Path) -> None:
    db = node / "state" / "nw.db"
    nanwatch("scan", "--db", str(db), str(node / "logs"))
    code, out = doctor("--config", str(config(node)))
    assert code == 0, out
    assert (
        f"intact, schema {SCHEMA_VERSION}" in out and "auto_vacuum" not in out and "WAL" not in out
    )
    store = Store.open(db)
    store.execute("PRAGMA user_version = 99")
    store.close()
    code, out = doctor("--config", str(config(node)))
    assert code == 1 and "written by a newer nanwatch (schema 99" in out and "fix: upgrade" in out


def test_missing_sources_warn_and_nothing_to_watch_fails(node: Path) -> None:
    cfg = node / "c.toml"
    cfg.write_text(f'[sources]\npaths = ["{node / "later"}", "{node / "x" / "*.log"}"]\n')
    code, out = doctor("--config", str(cfg), "--db", str(node / "nw.db"))
    assert code == 0, out
    assert "later: does not exist yet" in out and "matches nothing yet" in out
    code, out = doctor("--config", str(config(node)), "--db", str(node / "logs" / "nw.db"))
    assert "lies under the source" in out and "nanwatch would follow its own files" in out
    cfg.write_text("[sources]\nmode = 'poll'\n")
    code, out = doctor("--config", str(cfg), "--db", str(node / "nw.db"))
    assert code == 1 and "nothing to watch" in out and "fix: list the training log folders" in out


def test_inotify_limits_too_low_say_polling_and_how_to_raise_them() -> None:
    ok = inotify_verdict(1000, 2, 8192, 128, (10, 1))
    assert ok.status == "ok"
    low = inotify_verdict(9000, 2, 8192, 128, (500, 3))
    assert low.status == "warn" and "polling will be used" in low.message
    assert "max_user_watches = 8192 is below the 9000 folder(s)" in low.message
    assert low.fix is not None and "fs.inotify.max_user_watches=524288" in low.fix
    assert "/etc/sysctl.d/" in low.fix
    few = inotify_verdict(10, 130, 8192, 128, None)
    assert few.status == "warn" and "fs.inotify.max_user_instances=1024" in (few.fix or "")


def test_slack_auth_test(node: Path, slack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    token = node / "slack-token"
    token.write_text(GOOD + "\n")
    token.chmod(0o600)
    section = f'[slack]\nchannel = "#alerts"\nbase_url = "{slack}"\ntoken_file = "{token}"\n'
    code, out = doctor("--config", str(config(node, section)))
    assert code == 0, out
    assert "the token works (authenticated as nanwatch in ml-infra)" in out
    assert _Slack.seen[-1] == "/api/auth.test"

    token.write_text("xoxb-revoked-9999\n")
    code, out = doctor("--config", str(config(node, section)))
    assert code == 1 and "refused the token: invalid_auth" in out and "xoxb-revoked" not in out

    # the unit's LoadCredential= copy, when the config names no token_file
    creds = node / "creds"
    creds.mkdir()
    (creds / "slack-token").write_text(GOOD)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    section = f'[slack]\nchannel = "#alerts"\nbase_url = "{slack}"\n'
    code, out = doctor("--config", str(config(node, section)))
    assert code == 0 and "authenticated as nanwatch" in out


def test_slack_without_token_or_route(node: Path) -> None:
    code, out = doctor("--config", str(config(node, '[slack]\nchannel = "#alerts"\n')))
    assert code == 1 and "no bot token or webhook URL" in out and "LoadCredential" in out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/api/"  # nobody listens once closed
    token = node / "t"
    token.write_text(GOOD)
    token.chmod(0o600)
    section = f'[slack]\nchannel = "#a"\nbase_url = "{dead}"\ntoken_file = "{token}"\n'
    code, out = doctor("--config", str(config(node, section)))
    assert code == 1 and "cannot reach" in out and "HTTPS_PROXY" in out


def test_metrics_address_taken_by_another_program(node: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = config(node, f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        code, out = doctor("--config", str(cfg))
    assert code == 1 and "in use by another program" in out
