"""People acknowledge and resolve incidents; a relaunch that trains past the failure resolves
the old incident by itself."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from nanwatch.cli import cli
from nanwatch.demo.simulate import TrainingRun

from ..slack_server import TOKEN, SlackServer


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.fixture
def scanned(tmp_path: Path, db: Path) -> Path:
    run = TrainingRun(tmp_path / "work_dirs" / "dino", ranks=2, nan_rank=1, nan_at=(1, 5))
    run.write()
    assert run_cli("scan", "--db", str(db), str(run.work_dir)).exit_code == 0
    return db


def show(db: Path, iid: int = 1) -> dict[str, object]:
    r = run_cli("show", str(iid), "--db", str(db), "--json")
    assert r.exit_code == 0, r.output
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_ack_then_resolve_are_stored_and_shown(scanned: Path) -> None:
    before = show(scanned)
    assert before["acked_by"] is None and before["resolved_by"] is None
    r = run_cli("ack", "1", "--db", str(scanned), "--note", "on it", env={"SUDO_USER": "alice"})
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("#1: Acknowledged by alice at 20") and "on it" in r.stdout
    inc = show(scanned)
    assert inc["acked_by"] == "alice" and inc["ack_note"] == "on it"
    assert str(inc["acked_at"]).endswith("Z") and inc["status"] == "open"
    assert inc["version"] == int(before["version"]) + 1  # type: ignore[call-overload]
    story = run_cli("show", "1", "--db", str(scanned)).stdout
    assert "Acknowledged by alice at " in story and ": on it" in story

    r = run_cli(
        "resolve", "1", "--db", str(scanned), "--note", "bad batch dropped", "--json",
        env={"SUDO_USER": "", "USER": "bob"},
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    inc = json.loads(r.stdout)
    assert inc["status"] == "resolved" and inc["resolved_by"] == "bob"
    assert inc["resolution"] == "bad batch dropped" and inc["resolved_at"]
    assert "Resolved by bob at " in run_cli("show", "1", "--db", str(scanned)).stdout
    # every earlier key is still there
    assert set(before) - {"events", "timeline"} <= set(inc)

    again = run_cli("resolve", "1", "--db", str(scanned))
    assert again.exit_code == 1 and "already resolved" in again.stderr
    assert run_cli("ack", "1", "--db", str(scanned)).exit_code == 1
    missing = run_cli("ack", "9", "--db", str(scanned))
    assert missing.exit_code == 1 and "no incident #9" in missing.stderr


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    with SlackServer() as srv:
        yield srv


def test_the_slack_parent_tells_who_and_when(slack: SlackServer, tmp_path: Path, db: Path) -> None:
    token = tmp_path / "slack-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = tmp_path / "nanwatch.toml"
    cfg.write_text(
        f'[slack]\nchannel = "#alerts"\ntoken_file = "{token}"\nbase_url = "{slack.base_url}"\n'
    )
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, nan_rank=0, nan_at=(1, 4))
    run.write()
    common = ["--config", str(cfg), "--db", str(db)]
    assert run_cli("scan", "--notify", *common, str(run.work_dir)).exit_code == 0
    (parent,) = slack.parents()
    assert run_cli("ack", "1", *common, env={"SUDO_USER": "alice"}).exit_code == 0
    # whichever process delivers the outbox next (here a scan that reads nothing new)
    assert run_cli("scan", "--notify", *common, str(run.work_dir)).exit_code == 0
    assert parent.edits, "the parent was not re-rendered"
    assert "acknowledged by alice at 20" in json.dumps(parent.edits[-1]["blocks"])
    assert any("Acknowledged by alice" in m.text for m in slack.replies(parent.ts))

    r = run_cli("resolve", "1", *common, "--note", "fixed", env={"SUDO_USER": "bob"})
    assert r.exit_code == 0
    assert run_cli("scan", "--notify", *common, str(run.work_dir)).exit_code == 0
    last = json.dumps(parent.edits[-1]["blocks"])
    assert "Resolved: #1" in last and "resolved by bob at 20" in last
    assert any("Resolved by bob" in m.text and "fixed" in m.text for m in slack.replies(parent.ts))


def test_a_relaunch_that_trains_past_the_failure_resolves_it(tmp_path: Path, db: Path) -> None:
    wd = tmp_path / "work_dirs" / "dino"
    # the first launch dies in a NaN at epoch 1 iter 10 (step 10)
    TrainingRun(wd, timestamp="20261130_101500", ranks=2, nan_rank=1, nan_at=(1, 10)).write()
    assert run_cli("scan", "--db", str(db), str(wd)).exit_code == 0
    assert show(db)["status"] == "open"
    # a relaunch that stops before step 10 proves nothing
    short = TrainingRun(
        wd, timestamp="20261201_090000", ranks=2, iters=8, epochs=1, nan_rank=None, nan_at=None,
        start=dt.datetime(2026, 12, 1, 9, 0, 0),
    )  # fmt: skip
    short.write()
    assert run_cli("scan", "--db", str(db), str(wd)).exit_code == 0
    assert show(db)["status"] == "open"
    # one that trains on to epoch 2 does
    TrainingRun(
        wd, timestamp="20261202_090000", ranks=2, epochs=2, nan_rank=None, nan_at=None,
        start=dt.datetime(2026, 12, 2, 9, 0, 0),
    ).write()  # fmt: skip
    assert run_cli("scan", "--db", str(db), str(wd)).exit_code == 0
    inc = show(db)
    assert inc["status"] == "resolved" and inc["resolved_by"] is None
    assert "dino/20261202_090000, a relaunch of the same experiment, trained to step" in str(
        inc["resolution"]
    )
    assert "past the incident's step 10" in str(inc["resolution"])
    # another experiment's runs never resolve it: covered by the experiment match above
