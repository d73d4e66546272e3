"""The notification commands: notify-test, silence, silences, plot; [slack] errors at start."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.demo.simulate import TrainingRun

from ..conftest import nanwatch
from ..slack_server import TOKEN, SlackServer


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    with SlackServer() as srv:
        yield srv


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.output


def write_config(tmp: Path, body: str, *, token: bool = True) -> Path:
    if token:
        t = tmp / "slack-token"
        t.write_text(TOKEN + "\n")
        t.chmod(0o600)
        body = body.replace("@TOKEN@", str(t))
    cfg = tmp / "nanwatch.toml"
    cfg.write_text(body)
    return cfg


def test_notify_test_prints_what_slack_answered(slack: SlackServer, tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        f'[slack]\nchannel = "#alerts"\ntoken_file = "@TOKEN@"\nbase_url = "{slack.base_url}"\n'
        'routes = [{ kinds = ["oom"], channel = "C0ONCALL1" }]\n',
    )
    code, out = invoke("notify-test", "--config", str(cfg))
    assert code == 0, out
    assert "auth.test" in out and "team=nanwatch test" in out and "bot_id=B0000" in out
    assert "chat.postMessage #alerts" in out and "conversations.info C0ONCALL1" in out
    assert TOKEN not in out
    assert all(c.headers.get("Authorization") == f"Bearer {TOKEN}" for c in slack.calls)

    slack.missing_channels.add("#alerts")
    code, out = invoke("notify-test", "--config", str(cfg), "--json")
    steps = [json.loads(line) for line in out.splitlines()]
    assert code == 1
    failed = [s for s in steps if not s["ok"]]
    assert failed[0]["error"] == "channel_not_found" and "/invite" in failed[0]["detail"]


def test_notify_test_reports_a_refused_token_and_an_unreachable_slack(
    slack: SlackServer, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path, f'[slack]\nchannel = "#a"\nbase_url = "{slack.base_url}"\n', token=False
    )
    code, out = invoke("notify-test", "--config", str(cfg), env={"SLACK_BOT_TOKEN": "xoxb-wrong"})
    assert code == 1 and "invalid_auth" in out and "token" in out
    slack.stop()
    code, out = invoke("notify-test", "--config", str(cfg), env={"SLACK_BOT_TOKEN": TOKEN})
    slack.start()
    assert code == 1 and "cannot reach" in out


def test_webhook_notify_test(slack: SlackServer, tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.write_text(slack.webhook_url)
    hook.chmod(0o600)
    cfg = write_config(tmp_path, f'[slack]\nwebhook_url_file = "{hook}"\n', token=False)
    code, out = invoke("notify-test", "--config", str(cfg))
    assert code == 0 and "HTTP 200 ok" in out
    assert len(slack.webhook_posts) == 1


@pytest.mark.parametrize(
    ("body", "env", "expected"),
    [
        ('[slack]\nchannel = "#a"\n', {}, "no bot token: set token_file"),
        ('[slack]\nchannel = "#a"\ntoken_file = "@TOKEN@"\n', {}, "chmod 600"),
        ('[slack]\nchannel = "#a"\ntoken_file = "/nonexistent/t"\n', {}, "no such file"),
    ],
)
def test_a_slack_section_that_cannot_work_fails_at_start(
    tmp_path: Path, body: str, env: dict[str, str], expected: str
) -> None:
    cfg = write_config(tmp_path, body)
    (tmp_path / "slack-token").chmod(0o640)
    logs = tmp_path / "logs"
    logs.mkdir()
    for command in (["watch", str(logs)], ["scan", "--notify", str(logs)]):
        code, out = invoke(*command, "--config", str(cfg), "--db", str(tmp_path / "nw.db"), env=env)
        assert code == (78 if command[0] == "watch" else 1), out
        assert "[slack]" in out and "token" in out and expected in out
    # a plain scan does not need Slack
    code, out = invoke("scan", str(logs), "--config", str(cfg), "--db", str(tmp_path / "nw.db"))
    assert code == 0, out


def test_silence_and_silences(tmp_path: Path) -> None:
    db = str(tmp_path / "nw.db")
    code, out = invoke(
        "silence",
        "--run",
        "dino/1",
        "--kind",
        "nan",
        "--for",
        "2h",
        "--comment",
        "bad shard",
        "--db",
        db,
    )
    assert code == 0 and "Silence 1: run dino/1 kind nan until" in out
    code, out = invoke("silence", "--kind", "slowdown", "--for", "0.001s", "--db", db)
    assert code == 0
    code, out = invoke("silences", "--json", "--db", db)
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["run"], r["kind"], r["comment"]) for r in rows] == [("dino/1", "nan", "bad shard")]
    code, out = invoke("silences", "--all", "--db", db)
    assert "expired" in out and "bad shard" in out
    assert invoke("silence", "--for", "1h", "--db", db)[0] == 2
    code, out = invoke("silence", "--kind", "nann", "--db", db)
    assert code == 2 and "unknown kind" in out
    code, out = invoke("silence", "--kind", "nan", "--for", "soon", "--db", db)
    assert code == 2 and "--for" in out


def test_plot_draws_a_png(tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "wd", ranks=4, nan_rank=2)
    run.write()
    db = str(tmp_path / "nw.db")
    assert invoke("scan", "--db", db, str(run.work_dir))[0] == 0
    out_png = tmp_path / "inc.png"
    code, out = invoke("plot", "1", "-o", str(out_png), "--db", db)
    assert code == 0, out
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "4 rank(s)" in out
    code, out = invoke("plot", "99", "-o", str(out_png), "--db", db)
    assert code == 1 and "no incident 99" in out


def test_secrets_stay_out_of_debug_logs(slack: SlackServer, tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "wd", ranks=2, nan_rank=1)
    run.write()
    hook = tmp_path / "hook"
    hook.write_text(slack.webhook_url)
    hook.chmod(0o600)
    bot = write_config(
        tmp_path,
        f'[slack]\nchannel = "#a"\ntoken_file = "@TOKEN@"\nbase_url = "{slack.base_url}"\n',
    )
    web = tmp_path / "webhook.toml"
    web.write_text(f'[slack]\nwebhook_url_file = "{hook}"\n')
    for i, cfg in enumerate((bot, web)):
        out = nanwatch(
            "scan",
            "--notify",
            "-vv",
            "--config",
            str(cfg),
            "--db",
            str(tmp_path / f"{i}.db"),
            str(run.work_dir),
        )
        if i == 0:
            assert "DEBUG slack_sdk" in out.stderr  # debug logging of the HTTP calls was on
        assert TOKEN not in out.stderr + out.stdout
        assert "/services/T0000" not in out.stderr + out.stdout
    assert len(slack.parents()) == 1 and len(slack.webhook_posts) == 1


def test_watch_with_a_slack_section_but_no_token_fails_at_start(tmp_path: Path) -> None:
    import subprocess

    from ..conftest import NANWATCH

    cfg = tmp_path / "nw.toml"
    cfg.write_text('[slack]\nchannel = "#training"\n')
    (tmp_path / "logs").mkdir()
    env = {
        k: v for k, v in os.environ.items() if k not in ("SLACK_BOT_TOKEN", "CREDENTIALS_DIRECTORY")
    }
    r = subprocess.run(
        [
            *NANWATCH,
            "watch",
            "--config",
            str(cfg),
            "--db",
            str(tmp_path / "db"),
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 78
    assert "[slack]" in r.stderr and "no bot token" in r.stderr and "token_file" in r.stderr


def test_the_token_can_come_from_a_systemd_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanwatch.config import load_config
    from nanwatch.notify.slack_api import slack_settings

    cfg = tmp_path / "nw.toml"
    cfg.write_text('[slack]\nchannel = "#training"\n')
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "slack-token").write_text("xoxb-from-credential\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    s = slack_settings(load_config(cfg))
    assert s is not None and s.token == "xoxb-from-credential"
    assert "credential" in s.secret_source
    (creds / "slack-token").write_text("\n")  # the unit's empty default: absent
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-from-env")
    s = slack_settings(load_config(cfg))
    assert s is not None and s.token == "xoxb-from-env"
