"""The read commands on a node: which database they open, filters that say when they match
nothing, and tables that fit the terminal (in-process, and in a real pseudo-terminal)."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from nanwatch.cli import _common, _filters, cli
from nanwatch.demo.simulate import TrainingRun
from nanwatch.events import KINDS

from ..conftest import ROOT

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cli(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """Two launches of one experiment, each with a NaN incident; scanned into a database."""
    work_dir = tmp_path / "work_dirs" / "dino-4scale_r50_8xb2-12e_coco"
    TrainingRun(work_dir, timestamp="20261130_101500", ranks=2, nan_rank=1, nan_at=(1, 5)).write()
    TrainingRun(
        work_dir,
        timestamp="20261201_090000",
        ranks=2,
        nan_rank=0,
        nan_at=(1, 8),
        start=dt.datetime(2026, 12, 1, 9, 0, 0),
    ).write()
    db = tmp_path / "var" / "nanwatch.db"
    db.parent.mkdir()
    r = run_cli("scan", "--db", str(db), str(work_dir))
    assert r.exit_code == 0, r.output
    return db


# -- which database -------------------------------------------------------------------------


@pytest.fixture
def service_node(tmp_path: Path, two_runs: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node where only the service's config names the database."""
    etc = tmp_path / "etc" / "nanwatch.toml"
    etc.parent.mkdir()
    etc.write_text(f'db = "{two_runs}"\n')
    monkeypatch.setattr(_common, "SYSTEM_CONFIG", etc)
    monkeypatch.delenv("NANWATCH_DB")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # an empty per-user path
    return etc


def test_read_commands_find_the_service_database(service_node: Path, two_runs: Path) -> None:
    for args in (["show", "1"], ["incidents"], ["events", "--limit", "1"], ["runs"]):
        r = run_cli(*args)
        assert r.exit_code == 0, (args, r.output)
        assert f"database {two_runs} (the `db` of {service_node})" in r.stderr
        assert str(two_runs) not in r.stdout
    r = run_cli("incidents", "--json")
    assert r.exit_code == 0 and r.stderr == ""
    assert [json.loads(x)["id"] for x in r.stdout.splitlines()] == [1, 2]


def test_explicit_choices_come_before_the_service_config(
    service_node: Path, two_runs: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.db"
    r = run_cli("incidents", "--db", str(other))
    assert r.exit_code == 1 and f"{other}: no database here yet" in r.stderr
    cfg = tmp_path / "mine.toml"
    cfg.write_text(f'db = "{other}"\n')
    r = run_cli("incidents", env={"NANWATCH_CONFIG": str(cfg)})
    assert r.exit_code == 1 and str(other) in r.stderr
    r = run_cli("incidents", env={"NANWATCH_DB": str(other)})
    assert r.exit_code == 1 and f"database {other} ($NANWATCH_DB)" in r.stderr


def test_no_database_anywhere_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_common, "SYSTEM_CONFIG", tmp_path / "etc" / "nanwatch.toml")
    monkeypatch.delenv("NANWATCH_DB")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    r = run_cli("show", "3")
    assert r.exit_code == 1
    assert str(tmp_path / "etc" / "nanwatch.toml") in r.stderr and "--config" in r.stderr


def test_a_broken_service_config_is_named(service_node: Path) -> None:
    service_node.write_text("db = 3\n")
    r = run_cli("incidents")
    assert r.exit_code == 1 and str(service_node) in r.stderr and "db" in r.stderr


# -- filters --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["incidents", "events"])
def test_an_unknown_kind_is_a_usage_error_listing_the_kinds(two_runs: Path, command: str) -> None:
    r = run_cli(command, "--db", str(two_runs), "--kind", "nans")
    assert r.exit_code == 2
    assert "'nans'" in r.stderr and all(k in r.stderr for k in KINDS)


def ids(r: Result) -> list[int]:
    assert r.exit_code == 0, r.output
    return [json.loads(x)["id"] for x in r.stdout.splitlines()]


def test_run_by_name_tail_or_glob(two_runs: Path) -> None:
    db = ["--db", str(two_runs)]
    full = "dino-4scale_r50_8xb2-12e_coco/20261130_101500"
    assert ids(run_cli("incidents", *db, "--json", "--run", full)) == [1]
    assert ids(run_cli("incidents", *db, "--json", "--run", "20261130_101500")) == [1]
    assert ids(run_cli("incidents", *db, "--json", "--run", "*/2026120*")) == [2]
    assert ids(run_cli("incidents", *db, "--json", "--run", "dino-*")) == [1, 2]
    events = run_cli("events", *db, "--json", "--run", "20261201_090000")
    assert {json.loads(x)["run"] for x in events.stdout.splitlines()} == {
        "dino-4scale_r50_8xb2-12e_coco/20261201_090000"
    }


def test_run_that_matches_nothing_lists_the_runs(two_runs: Path) -> None:
    r = run_cli("incidents", "--db", str(two_runs), "--run", "101500")  # not a whole component
    assert r.exit_code == 2
    assert (
        "matches no run" in r.stderr and "dino-4scale_r50_8xb2-12e_coco/20261130_101500" in r.stderr
    )


def test_ambiguous_run_tail_says_so(tmp_path: Path) -> None:
    for exp in ("dino", "yolo"):
        TrainingRun(tmp_path / "wd" / exp, ranks=1, nan_rank=0, nan_at=(1, 3)).write()
    db = tmp_path / "x.db"
    assert run_cli("scan", "--db", str(db), str(tmp_path / "wd")).exit_code == 0
    r = run_cli("events", "--db", str(db), "--run", "20261130_101500")
    assert r.exit_code == 2 and "ambiguous" in r.stderr
    assert "dino/20261130_101500" in r.stderr and "yolo/20261130_101500" in r.stderr


def test_since_until_and_limit(two_runs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = ["--db", str(two_runs), "--json"]
    # "now" is an hour after run B's NaN
    now = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.timezone.utc).timestamp()
    monkeypatch.setattr(_filters, "clock", lambda: now)
    assert ids(run_cli("incidents", *db, "--since", "2h")) == [2]
    assert ids(run_cli("incidents", *db, "--since", "2d")) == [1, 2]
    assert ids(run_cli("incidents", *db, "--until", "2026-11-30T23:00")) == [1]
    assert ids(run_cli("incidents", *db, "--since", "2026-12-01")) == [2]
    assert ids(run_cli("incidents", *db, "--limit", "1")) == [2]
    since = [json.loads(x) for x in run_cli("events", *db, "--since", "90m").stdout.splitlines()]
    assert since and all(e["time"] >= "2026-12-01T08:30:00.000Z" for e in since)
    r = run_cli("incidents", "--db", str(two_runs), "--since", "yesterday")
    assert r.exit_code == 2 and "--since 'yesterday'" in r.stderr and "2h" in r.stderr
    r = run_cli("incidents", "--db", str(two_runs), "--limit", "0")
    assert r.exit_code == 2
    r = run_cli("incidents", "--db", str(two_runs), "--since", "1m")
    assert r.exit_code == 0 and "with these filters" in r.stdout


# -- tables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["incidents", "events", "runs"])
@pytest.mark.parametrize("columns", [72, 80, 100, 132])
def test_every_line_fits_columns(two_runs: Path, command: str, columns: int) -> None:
    r = run_cli(command, "--db", str(two_runs), env={"COLUMNS": str(columns)})
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert max(len(x) for x in lines) <= columns
    if command != "runs" or columns >= 80:
        # the run keeps its distinguishing tail, whole
        assert any("20261130_101500" in x for x in lines[2:])


def test_piped_without_columns_has_no_limit(two_runs: Path) -> None:
    r = run_cli("incidents", "--db", str(two_runs), env={"COLUMNS": ""})
    assert "dino-4scale_r50_8xb2-12e_coco/20261130_101500" in r.stdout
    assert "2026-11-30T10:15:09" in r.stdout  # the full time
    assert not ANSI.search(r.stdout)


def _in_a_terminal(args: list[str], cols: int, env: dict[str, str]) -> str:
    """Run the CLI with stdout on a pseudo-terminal ``cols`` wide; what the terminal got."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    full = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanwatch", *args],
        stdout=slave,
        stderr=subprocess.PIPE,
        env={**full, **env},
        cwd=ROOT,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(master)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_a_real_terminal_gets_its_width_and_colour(two_runs: Path) -> None:
    out = _in_a_terminal(["incidents", "--db", str(two_runs)], 70, {})
    lines = out.splitlines()
    assert "\x1b[1;31m" in out  # critical and open: red
    assert max(len(ANSI.sub("", x)) for x in lines) <= 70
    assert any("20261201_090000" in ANSI.sub("", x) for x in lines)
    plain = _in_a_terminal(["incidents", "--db", str(two_runs)], 70, {"NO_COLOR": "1"})
    assert not ANSI.search(plain) and ANSI.sub("", out) == plain


def test_runs_keep_their_start_end_and_status(two_runs: Path) -> None:
    import sqlite3

    conn = sqlite3.connect(two_runs)
    spans = conn.execute("SELECT name, first_time, last_time FROM runs ORDER BY id").fetchall()
    conn.close()
    # what datasette users see too: the span the logs tell, written with the events
    assert all(first and last and first < last for _, first, last in spans)
    r = run_cli("runs", "--db", str(two_runs), "--json")
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    # the relaunch trained past the first run's NaN (step 5): that incident resolved itself
    assert [x["status"] for x in rows] == ["resolved", "failing"]
    assert rows[1]["first_time"].startswith("2026-12-01T09:0")
    table = run_cli("runs", "--db", str(two_runs), env={"COLUMNS": "132"}).stdout
    assert "START" in table and "END" in table and "failing" in table
