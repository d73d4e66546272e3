"""Messages that lead somewhere: hints with their values filled in, a garbage checkpoint
named as such, `doctor PATH...`, and config errors that say what to edit."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner, Result

from nanwatch.cli import cli
from nanwatch.demo.simulate import demo_scenario


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def test_hints_name_the_incident_the_run_config_and_its_annotation_file(
    tmp_path: Path, db: Path
) -> None:
    run_a, run_b = demo_scenario(tmp_path)
    run_a.write()
    run_b.write()
    assert run_cli("scan", "--db", str(db), str(run_a.work_dir)).exit_code == 0
    r = run_cli("incidents", "--db", str(db), "--json")
    incidents = {i["kind"]: i for i in map(json.loads, r.stdout.splitlines())}
    commands = {k: [c for h in i["hints"] for c in h["commands"]] for k, i in incidents.items()}
    everything = json.dumps(commands)
    assert "<incident id>" not in everything and "<annotations.json>" not in everything
    slowdown = incidents["slowdown"]
    assert f"nanwatch plot {slowdown['id']} -o steps.png" in commands["slowdown"]
    # the OOM hint greps the config file mmengine dumped into the work_dir, which exists
    (grep,) = [c for c in commands["oom"] if c.startswith("grep")]
    config = Path(grep.rsplit(" ", 1)[-1])
    assert config == run_a.work_dir / "dino-4scale_r50_8xb2-12e_coco.py" and config.is_file()
    # the NaN hint checks the annotation file and classes that config names
    ann = tmp_path / "data" / "annotations" / "instances_train.json"
    assert f"nanwatch check-dataset {ann} --classes person,car,bicycle" in commands["nan"]


def test_a_garbage_checkpoint_is_not_a_checkpoint(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"<html>404 Not Found</html>\n")
    r = run_cli("shapes", str(bad))
    assert r.exit_code == 1
    assert f"{bad}: not a checkpoint" in r.stderr and "nanwatch[shapes]" not in r.stderr


def test_doctor_checks_the_paths_it_is_given(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("hello\n")
    r = run_cli("doctor", "--db", str(tmp_path / "x.db"), "--json", str(logs))
    findings = [json.loads(x) for x in r.stdout.splitlines()]
    sources = [f for f in findings if f["check"] == "sources"]
    assert sources and all(f["status"] == "ok" for f in sources)
    assert str(logs) in sources[0]["message"]
    assert not any("nothing to watch" in f["message"] for f in findings)
    # without PATH or [sources] paths, the fix names both ways
    r = run_cli("doctor", "--db", str(tmp_path / "x.db"))
    assert "nanwatch doctor PATH" in r.stdout


def test_a_config_error_says_what_to_edit(tmp_path: Path) -> None:
    cfg = tmp_path / "nw.toml"
    cfg.write_text("[sources]\npaths = ['/tmp']\npoll_intervall = 2\n")
    r = run_cli("doctor", "--config", str(cfg))
    assert r.exit_code == 1
    fix = re.search(r"fix: (.*)", r.stdout)
    assert fix is not None
    assert fix.group(1).startswith(f"rename or remove poll_intervall in [sources] of {cfg}")
    assert "as the message says" not in r.stdout
    cfg.write_text("[slack]\nchannel = 5\n")
    r = run_cli("doctor", "--config", str(cfg))
    assert f"correct the value of channel in [slack] of {cfg}" in r.stdout
