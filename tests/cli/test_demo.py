"""`nanwatch demo` is a replay: it tells the same story every time, and a root cause that
changes is told again in full."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.cli.demo import replay
from nanwatch.notify.console import ConsoleSink
from nanwatch.store.records import OutboxRow


def test_the_replay_tells_the_same_story_five_times(tmp_path: Path) -> None:
    base = tmp_path / "demo"
    outputs = []
    for _ in range(5):
        shutil.rmtree(base, ignore_errors=True)
        out = io.StringIO()
        replay(base, out)
        outputs.append(out.getvalue())
    assert all(o == outputs[0] for o in outputs[1:])
    text = outputs[0]
    # the NaN's first story already names rank 6, and no line repeats an update
    nan = text[text.index("[open] nan") :]
    assert "first on rank 6" in nan.splitlines()[1]
    updates = [x for x in text.splitlines() if x.startswith("[update]")]
    assert len(updates) == len(set(updates))
    # the simulated clock, not the wall clock, dates what was read
    assert "first: 2026-12-01T09:" in nan


def test_the_demo_command_prints_the_incidents_table(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli, ["demo", "--speed", "0", "--dir", str(tmp_path / "d")], env={"COLUMNS": "100"}
    )
    assert r.exit_code == 0, r.output
    table = r.output[r.output.index("$ nanwatch incidents") :].split("\n\n")[0].splitlines()[1:]
    assert table[0].split()[:4] == ["ID", "STATUS", "KIND", "RUN"]
    assert max(len(x) for x in table) <= 100
    assert "20261130_101500" in table[2] and "20261201_090000" in table[-1]
    # the same table `nanwatch incidents` prints
    same = CliRunner().invoke(
        cli, ["incidents", "--db", str(tmp_path / "d" / "nanwatch.db")], env={"COLUMNS": "100"}
    )
    assert same.stdout.splitlines() == table


def _incident(rank: int, events: int) -> dict[str, Any]:
    return {
        "id": 2,
        "kind": "nan",
        "status": "open",
        "title": f"Loss is NaN, first on rank {rank}",
        "ranks": list(range(8)),
        "event_count": events,
        "origin": {"rank": rank, "step": 163},
        "detail": {"root_cause": f"rank {rank} cause"},
    }


def _row(action: str) -> OutboxRow:
    return OutboxRow(1, 2, "console", action, {}, f"console:2:{action}", "", 0.0, 0, None, None)


def test_a_corrected_root_cause_is_told_in_full() -> None:
    out = io.StringIO()
    sink = ConsoleSink(out, color=False)
    sink.deliver(_row("open"), _incident(0, 8))
    sink.deliver(_row("update"), _incident(0, 9))
    sink.deliver(_row("update"), _incident(0, 9))  # nothing new: not printed again
    sink.deliver(_row("update"), _incident(6, 12))
    lines = out.getvalue().splitlines()
    assert sum(x.startswith("[update] #2") for x in lines) == 1
    at = next(i for i, x in enumerate(lines) if x.startswith("[corrected] #2"))
    assert "it was: rank 0, step 163" in lines[at]
    story = "\n".join(lines[at:])
    assert "Root cause: rank 6 cause" in story and "Origin: rank 6, step 163" in story
