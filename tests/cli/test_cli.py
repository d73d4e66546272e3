"""The CLI, in-process (CliRunner) and as a subprocess: formats, exit codes, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import COMMANDS, cli
from nanwatch.demo.simulate import TrainingRun

from ..conftest import nanwatch


@pytest.fixture
def scanned(tmp_path: Path, db: Path) -> Path:
    run = TrainingRun(tmp_path / "work_dirs" / "dino", ranks=4, nan_rank=2, nan_at=(1, 10))
    run.write()
    r = CliRunner().invoke(cli, ["scan", "--db", str(db), str(run.work_dir)])
    assert r.exit_code == 0, r.output
    return db


def invoke(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args))
    return r.exit_code, r.output


def test_scan_summary_and_exit_codes(tmp_path: Path, db: Path) -> None:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, nan_rank=1, nan_at=(1, 4))
    run.write()
    code, out = invoke("scan", "--db", str(db), str(run.work_dir))
    assert code == 0 and "1 incident(s)" in out and "nan" in out
    code, out = invoke("scan", "--db", str(db), "--fail-on", "nan", str(run.work_dir))
    assert code == 3
    code, out = invoke("scan", "--db", str(db), "--fail-on", "oom", str(run.work_dir))
    assert code == 0
    code, out = invoke("scan", "--db", str(db), "--json", str(run.work_dir))
    summary = json.loads(out)
    assert summary["events"] == {}  # nothing new the second time
    assert [i["kind"] for i in summary["incidents"]] == ["nan"]


def test_incidents_json_is_one_object_per_line(scanned: Path) -> None:
    code, out = invoke("incidents", "--db", str(scanned), "--json")
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    inc = json.loads(lines[0])
    assert {
        "id",
        "kind",
        "title",
        "status",
        "run",
        "experiment",
        "ranks",
        "first_time",
        "last_time",
        "event_count",
        "origin",
        "hints",
    } <= set(inc)
    assert (
        inc["origin"]["rank"] == 2 and inc["origin"]["epoch"] == 1 and inc["origin"]["iter"] == 10
    )
    assert inc["ranks"] == [0, 1, 2, 3]
    code, out = invoke("incidents", "--db", str(scanned), "--open")
    assert code == 0 and "nan" in out


def test_show_json_one_object_with_events(scanned: Path) -> None:
    code, out = invoke("show", "--db", str(scanned), "1", "--json")
    assert code == 0
    assert len(out.strip().splitlines()) == 1
    inc = json.loads(out)
    assert len(inc["events"]) == inc["event_count"]
    assert "hints" in inc and "timeline" in inc
    code, out = invoke("show", "--db", str(scanned), "1")
    assert "Origin: rank 2" in out and "nanwatch show 1" in out
    code, out = invoke("show", "--db", str(scanned), "99")
    assert code == 1 and "no incident #99" in out


def test_events_oldest_first_all_and_limit(scanned: Path) -> None:
    code, out = invoke("events", "--db", str(scanned), "--json")
    evs = [json.loads(x) for x in out.strip().splitlines()]
    assert [e["id"] for e in evs] == sorted(e["id"] for e in evs)
    assert len(evs) > 20
    e = evs[0]
    assert set(e) >= {
        "id",
        "kind",
        "time",
        "ingested_at",
        "run",
        "file",
        "line",
        "rank",
        "local_rank",
        "node",
        "epoch",
        "iter",
        "step",
        "stage",
        "device",
        "message",
        "fields",
    }
    assert e["time"].endswith("Z") and len(e["time"]) == len("2026-11-30T10:00:00.123Z")
    assert e["ingested_at"].endswith("Z")
    code, out = invoke("events", "--db", str(scanned), "--json", "--limit", "3")
    last3 = [json.loads(x) for x in out.strip().splitlines()]
    assert [x["id"] for x in last3] == [x["id"] for x in evs[-3:]]
    code, out = invoke("events", "--db", str(scanned), "--kind", "oom")
    assert code == 0 and "No events" in out


def test_runs_json(scanned: Path) -> None:
    code, out = invoke("runs", "--db", str(scanned), "--json")
    assert code == 0
    runs = [json.loads(x) for x in out.strip().splitlines()]
    assert [r["name"] for r in runs] == ["dino/20261130_101500"]
    assert runs[0]["experiment"] == "dino"
    assert "facts" in runs[0]


def test_readers_on_a_missing_database(tmp_path: Path) -> None:
    code, out = invoke("incidents", "--db", str(tmp_path / "nope.db"))
    assert code == 1 and "no database here yet" in out


def test_config_error_names_file_key_and_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "nw.toml"
    cfg.write_text("[sources]\npaths = ['/tmp']\npoll_intervall = 2\n")
    code, out = invoke("watch", "--config", str(cfg), "--db", str(tmp_path / "x.db"))
    assert code == 78  # EX_CONFIG: systemd does not restart it in a loop
    assert str(cfg.resolve()) in out and "poll_intervall" in out and "poll_interval" in out


def test_watch_without_paths_is_an_error(tmp_path: Path) -> None:
    code, out = invoke("watch", "--db", str(tmp_path / "x.db"))
    assert code == 78 and "nothing to watch" in out


def test_scan_missing_path(tmp_path: Path) -> None:
    code, out = invoke("scan", "--db", str(tmp_path / "x.db"), str(tmp_path / "missing"))
    assert code == 1 and "no such file or directory" in out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_with_examples(command: str) -> None:
    code, out = invoke(command, "--help")
    assert code == 0
    assert "Example" in out


def test_subprocess_help_and_version() -> None:
    out = nanwatch("--help").stdout
    for name in COMMANDS:
        assert name in out
    assert "0.1.0" in nanwatch("--version").stdout


def test_subprocess_scan_then_query(tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, nan_rank=0, nan_at=(2, 3))
    run.write()
    db = tmp_path / "sub.db"
    nanwatch("scan", "--db", str(db), str(run.work_dir))
    out = nanwatch("incidents", "--db", str(db), "--json").stdout
    inc = json.loads(out.splitlines()[0])
    assert inc["origin"]["epoch"] == 2 and inc["origin"]["iter"] == 3 and inc["origin"]["rank"] == 0
