"""Golden cases: tests/fixtures/<case>/ holds input files and expected.json (STYLE.md, 6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.query import iter_events, list_incidents
from nanwatch.store import Store

FIXTURES = Path(__file__).parent.parent / "fixtures"
CASES = sorted(p.parent for p in FIXTURES.glob("*/expected.json"))


def subset(expected: Any, actual: Any, where: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected an object, got {actual!r}"
        for k, v in expected.items():
            assert k in actual, f"{where}.{k} missing in {sorted(actual)}"
            subset(v, actual[k], f"{where}.{k}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (
            f"{where}: expected {len(expected)} items, got {actual!r}"
        )
        for i, (e, a) in enumerate(zip(expected, actual)):
            subset(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: expected {expected!r}, got {actual!r}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden(case: Path, tmp_path: Path) -> None:
    expected = json.loads((case / "expected.json").read_text())
    inputs = [str(p) for p in sorted(case.iterdir()) if p.name != "expected.json"]
    store = Store.open(tmp_path / "db.sqlite")
    try:
        pipe = Pipeline(Config(), store, inputs)
        pipe.scan()
        events = list(iter_events(store._conn))
        incidents = list_incidents(store._conn)
        counts: dict[str, int] = {}
        for e in events:
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        if "events" in expected:
            assert counts == expected["events"]
        if "first_event" in expected:
            first = min(events, key=lambda e: (e["step"] is None, e["step"] or 0, e["id"]))
            subset(expected["first_event"], first, "first_event")
        if "incidents" in expected:
            subset(expected["incidents"], incidents, "incidents")
        if "metrics" in expected:
            assert pipe.stats.metrics == expected["metrics"]
    finally:
        store.close()
