"""--json is a stable interface: every command's keys, nested ones too, stay put.

Keys may be added later, never renamed or removed: the test fails on a missing key, never on an
extra one. Maps whose keys are open by design (an event's ``fields``, a run's ``facts``, an
incident's ``detail``, counters by name) are pinned as keys only, not their contents.

A pin is ``{key: sub}``: ``None`` for a value whose inside is not pinned, a dict for a nested
object, ``[dict]`` for a list of objects (every element must have the keys).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from nanwatch.cli import COMMANDS, cli

from ..slack_server import TOKEN, SlackServer

FIXTURES = Path(__file__).parent.parent / "fixtures"

Pin = dict[str, Any]


def keys(words: str) -> Pin:
    return dict.fromkeys(words.split())


EVENT: Pin = keys(
    "id kind time ingested_at run file line rank local_rank node epoch iter step stage device "
    "message fields incident"
)
ORIGIN: Pin = keys("rank step epoch iter stage phase tag tensor shape dtype module first_param")
INCIDENT: Pin = {
    **keys(
        "id kind title status run experiment ranks first_time last_time event_count severity "
        "detail created_at updated_at resolved_at version node job cluster_run nodes acked_by "
        "acked_at ack_note resolved_by resolve_note resolution"
    ),
    "origin": ORIGIN,
    "hints": [dict.fromkeys(["id", "title", "text", "commands"])],
}
SHOW: Pin = {
    **INCIDENT,
    "events": [EVENT],
    "timeline": [keys("rank kind count first_time last_time first_step last_step node")],
}
RUN: Pin = keys(
    "id name path launch experiment job cluster_run node nodes created_at sources events "
    "incidents facts first_time last_time open_incidents status"
)
METRIC: Pin = keys(
    "run rank epoch iter step stage time loss grad_norm step_time data_time lr memory"
)
SCAN: Pin = {
    **keys("database files bytes seconds events metrics runs undelivered counters"),
    "incidents": [INCIDENT],
}
SILENCE: Pin = keys("id run kind until until_utc created_at comment active")
# chunk, lines, incident: only the rule types that have them
RULE: Pin = keys("id pack type kind tier literals pattern examples source")
EXPLAIN: Pin = {
    "matches": [dict.fromkeys(["rule", "type", "kind", "pack", "tier", "values"])],
    "events": [
        keys(
            "kind message offset key time file line rank local_rank node epoch iter step stage "
            "device fields"
        )
    ],
    "metrics": [
        keys("offset rank step epoch iter stage time loss grad_norm step_time data_time lr memory")
    ],
    "facts": None,
    "state": dict.fromkeys(["stage", "epoch", "iter", "step"]),
}
DOCTOR: Pin = dict.fromkeys(["check", "status", "message", "fix"])
MERGE: Pin = {
    "database": None,
    "merged": [keys("path origin nodes runs sources events metrics")],
    "changes": None,
    "resolved": None,
    "incidents": [INCIDENT],
}
DATASET: Pin = {
    **keys("images_total annotations_total classes unknown_classes reasons out_of_range"),
    "empty_gt_images": [
        dict.fromkeys(["image_id", "file_name", "reason", "out_of_range", "degenerate"])
    ],
}
NOTIFY_TEST: Pin = dict.fromkeys(["step", "ok"])
SHAPE: Pin = dict.fromkeys(["name", "shape", "module"])


def missing(pin: Pin, value: Any, at: str = "") -> list[str]:
    """The pinned keys ``value`` lacks, as paths (``hints[].commands``)."""
    if not isinstance(value, dict):
        return [f"{at or '.'}: not an object ({type(value).__name__})"]
    out: list[str] = []
    for key, sub in pin.items():
        path = f"{at}.{key}" if at else key
        if key not in value:
            out.append(path)
        elif isinstance(sub, dict):
            out += missing(sub, value[key], path)
        elif isinstance(sub, list):
            items = value[key]
            if not isinstance(items, list):
                out.append(f"{path}: not a list")
                continue
            for item in items:
                out += missing(sub[0], item, path + "[]")
    return sorted(set(out))


def lines(args: list[str], *, code: int = 0, input: str | None = None) -> list[Any]:
    r = CliRunner().invoke(cli, args, input=input)
    assert r.exit_code == code, r.output
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def one(args: list[str], **kw: Any) -> Any:
    (value,) = lines(args, **kw)
    return value


def check(pin: Pin, values: list[Any]) -> None:
    assert values, "the command printed nothing to check"
    problems = sorted({p for v in values for p in missing(pin, v)})
    assert not problems, f"keys gone from --json: {problems}"


@pytest.fixture(scope="module")
def scanned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Two real fixtures scanned into one database: a NaN with its origin and an OOM whose
    collective timeouts are symptoms (known causes, timeline over ranks)."""
    tmp = tmp_path_factory.mktemp("json")
    paths = []
    for case in ("mmengine_nan_e1i10", "npu_val_oom_hccl"):
        shutil.copytree(FIXTURES / case / "work_dir", tmp / case)
        paths.append(str(tmp / case))
    db = tmp / "nw.db"
    summary = one(["scan", "--json", "--db", str(db), *paths])
    yield db, summary


def test_every_json_command_is_pinned() -> None:
    """A new command with --json gets a pin here."""
    with_json = set()
    for name in COMMANDS:
        cmd = cli.get_command(None, name)  # type: ignore[arg-type]
        assert cmd is not None
        if any("--json" in getattr(p, "opts", ()) for p in cmd.params):
            with_json.add(name)
    assert with_json == {
        "scan", "incidents", "show", "events", "runs", "ack", "resolve", "silence", "silences",
        "rules", "explain", "doctor", "merge", "check-dataset", "notify-test", "shapes",
        "fleet",  # pinned in test_fleet.py: it needs a PostgreSQL server
        "metrics",
    }  # fmt: skip


def test_scan(scanned: tuple[Path, dict[str, Any]]) -> None:
    _, summary = scanned
    check(SCAN, [summary])
    assert {i["kind"] for i in summary["incidents"]} == {"nan", "oom"}


def test_metrics(scanned: tuple[Path, dict[str, Any]]) -> None:
    rows = lines(["metrics", "--db", str(scanned[0]), "--json"])
    assert rows
    check(METRIC, rows)


def test_read_commands(scanned: tuple[Path, dict[str, Any]]) -> None:
    db = ["--db", str(scanned[0]), "--json"]
    incidents = lines(["incidents", *db])
    check(INCIDENT, incidents)
    assert any(i["hints"] for i in incidents)
    check(EVENT, lines(["events", *db]))
    check(EVENT, lines(["events", *db, "--limit", "2"]))
    check(RUN, lines(["runs", *db]))
    shown = [one(["show", str(i["id"]), *db]) for i in incidents]
    check(SHOW, shown)
    assert all(s["events"] and s["timeline"] for s in shown)


def test_ack_resolve_silence(scanned: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    db = tmp_path / "copy.db"
    shutil.copy(scanned[0], db)
    flags = ["--db", str(db), "--json"]
    check(INCIDENT, [one(["ack", "1", *flags, "--note", "on it"])])
    check(INCIDENT, [one(["resolve", "1", *flags, "--note", "fixed"])])
    run = scanned[1]["runs"][0]
    check(SILENCE, [one(["silence", "--run", run, "--for", "1h", "--comment", "x", *flags])])
    check(SILENCE, lines(["silences", *flags]))


def test_merge(scanned: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    node = tmp_path / "node-a.db"
    shutil.copy(scanned[0], node)
    check(MERGE, [one(["merge", "--json", str(tmp_path / "fleet.db"), str(node)])])


def test_rules_explain_doctor(scanned: tuple[Path, dict[str, Any]]) -> None:
    check(RULE, lines(["rules", "--json"]))
    check(EXPLAIN, [one(["explain", "--json", "Epoch(train) [1][10/16]  loss: nan"])])
    logs = FIXTURES / "npu_val_oom_hccl" / "work_dir"
    check(DOCTOR, lines(["doctor", "--json", "--db", str(scanned[0]), str(logs)]))


def test_check_dataset(tmp_path: Path) -> None:
    ann = tmp_path / "train.json"
    ann.write_text(
        json.dumps(
            {
                "images": [
                    {"id": 1, "file_name": "a.jpg", "width": 64, "height": 64},
                    {"id": 2, "file_name": "b.jpg", "width": 64, "height": 64},
                ],
                "annotations": [
                    {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 9, 9], "area": 81},
                ],
                "categories": [{"id": 1, "name": "cat"}],
            }
        )
    )
    check(DATASET, [one(["check-dataset", "--json", str(ann)])])


def test_notify_test(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    with SlackServer() as slack:
        cfg = tmp_path / "nanwatch.toml"
        cfg.write_text(
            f'[slack]\nchannel = "#alerts"\ntoken_file = "{token}"\nbase_url = "{slack.base_url}"\n'
        )
        check(NOTIFY_TEST, lines(["notify-test", "--config", str(cfg), "--json"]))


def test_shapes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    ckpt = tmp_path / "epoch_1.pth"
    torch.save({"state_dict": {"head.fc.weight": torch.zeros(4, 3)}}, ckpt)
    check(SHAPE, lines(["shapes", "--json", str(ckpt)]))


def test_a_missing_key_fails() -> None:
    """The checker itself: a renamed key and a nested one are caught, an extra key is not."""
    value = {"a": 1, "b": {"c": 2}, "l": [{"x": 1}, {"y": 2}], "extra": 0}
    pin: Pin = {"a": None, "b": {"c": None, "d": None}, "l": [{"x": None}]}
    assert missing(pin, value) == ["b.d", "l[].x"]
    assert missing({"a": None, "extra": None}, value) == []
