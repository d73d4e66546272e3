"""The msprobe golden runs, checked beyond expected.json: one incident, never a placeholder."""

from __future__ import annotations

import csv
import json
import sqlite3
from pathlib import Path

import pytest

from ..conftest import nanwatch

FIXTURES = Path(__file__).parent.parent / "fixtures"
CASES = sorted(p for p in FIXTURES.glob("msprobe_*") if (p / "expected.json").is_file())


def placeholders(run: Path) -> set[tuple[int, int, str]]:
    """(rank, step, name) of every all-NaN placeholder row msprobe wrote."""
    out = set()
    for f in run.glob("monitor_output/*-rank*-*/*.csv"):
        rank = int(f.parent.name.split("-rank")[1].split("-")[0])
        with f.open() as fh:
            for row in csv.DictReader(fh):
                stats = [
                    v
                    for k, v in row.items()
                    if k not in ("vpp_stage", "name", "step", "micro_step")
                ]
                if all(v == "nan" for v in stats):
                    out.add((rank, int(row["step"]), row["name"]))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_incident_never_rooted_in_a_placeholder(case: Path, tmp_path: Path) -> None:
    db = tmp_path / "db"
    run = case / "run"
    summary = json.loads(nanwatch("scan", "--db", str(db), "--json", str(run)).stdout)
    assert [i["kind"] for i in summary["incidents"]] == ["nan"]
    assert summary["runs"] == ["run"]
    phs = placeholders(run)
    assert phs, "the fixture has placeholder rows"
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT rank, step, fields FROM events WHERE kind='nan'").fetchall()
        n = len(rows)
    finally:
        conn.close()
    for rank, step, fields in rows:
        f = json.loads(fields)
        if step is None:
            assert "via" not in f  # the framework's own loss lines
            continue
        assert step > 0
        assert (rank, step, f["tensor"]) not in phs
    o = summary["incidents"][0]["origin"]
    assert (o["rank"], o["step"], o["tensor"]) not in phs and o["step"] > 0
    # scanning again adds nothing
    again = json.loads(nanwatch("scan", "--db", str(db), "--json", str(run)).stdout)
    assert again["events"] == {}
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == n
        assert conn.execute("SELECT count(*) FROM incidents").fetchone()[0] == 1
    finally:
        conn.close()
    story = nanwatch("show", "--db", str(db), str(summary["incidents"][0]["id"])).stdout
    assert "Root cause: the NaN was produced inside the backward of `layers.1`" in story
    assert "First parameter gradient non-finite" in story
    assert ("may be shortened by msprobe's squash_name" in story) is ("squashed" in case.name)
