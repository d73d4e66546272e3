"""Detection quality on the labelled real excerpts in ../shared/reallogs (skipped when absent).

Every sample is scanned alone through the real pipeline into a fresh database. Incident samples
must give an event of the matching kind and (nearly always) an incident of it; negatives must
open no incident; the earliest matching event's stage, rank, epoch and iteration must agree with
the labels where the text shows them. ``pytest -s`` prints the counts table.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.query import iter_events, list_incidents
from nanwatch.store import Store


def _find_reallogs() -> Path:
    """../shared/reallogs beside the checkout (CI), or beside the folder of worktrees."""
    if os.environ.get("NANWATCH_REALLOGS"):
        return Path(os.environ["NANWATCH_REALLOGS"])
    root = Path(__file__).resolve().parents[2]
    for base in (root.parent, root.parent.parent):
        if (base / "shared" / "reallogs" / "labels.jsonl").exists():
            return base / "shared" / "reallogs"
    return root.parent / "shared" / "reallogs"


REALLOGS = _find_reallogs()

# label kind -> event kinds that count as the right detection
KINDS: dict[str, tuple[str, ...]] = {
    "nan_loss": ("nan", "overflow"),
    "hccl_timeout": ("comm_timeout", "comm_error"),
    "nccl_timeout": ("comm_timeout", "comm_error"),
    "oom": ("oom",),
    "process_failure": ("process_failure",),
}
FIELDS = ("stage", "rank", "epoch", "iter")


@dataclass
class Outcome:
    file: str
    kind: str
    events: list[dict[str, Any]]
    incidents: list[dict[str, Any]]
    label: dict[str, Any]
    fields: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (want, got)

    @property
    def wanted(self) -> tuple[str, ...]:
        return KINDS.get(self.kind, ())

    @property
    def detected(self) -> bool:
        return any(e["kind"] in self.wanted for e in self.events)

    @property
    def opened(self) -> bool:
        return any(i["kind"] in self.wanted for i in self.incidents)

    @property
    def clean(self) -> bool:
        return not self.incidents


def _labels() -> list[dict[str, Any]]:
    rows = []
    for line in (REALLOGS / "labels.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def _want(label: dict[str, Any], name: str) -> Any:
    key = "step_or_iter" if name == "iter" else name
    value = label.get(key)
    if value in (None, "unknown", ""):
        return None
    return value


def _got(event: dict[str, Any], name: str) -> Any:
    if name == "iter":
        return event["iter"] if event["iter"] is not None else event["step"]
    return event[name]


def scan_one(path: Path, label: dict[str, Any], tmp: Path) -> Outcome:
    store = Store.open(tmp / f"{path.stem}.db")
    try:
        Pipeline(Config(), store, [str(path)]).scan()
        events = list(iter_events(store._conn))
        incidents = list_incidents(store._conn)
    finally:
        store.close()
    out = Outcome(path.name, label["kind"], events, incidents, label)
    matching = [e for e in events if e["kind"] in out.wanted]
    if matching:
        first = min(matching, key=lambda e: e["id"])
        for name in FIELDS:
            want = _want(label, name)
            if want is not None:
                out.fields[name] = (want, _got(first, name))
    return out


def _outcomes(tmp: Path) -> Iterator[Outcome]:
    for label in _labels():
        path = REALLOGS / label["file"]
        if path.exists() and (label["kind"] in KINDS or label["kind"] == "none"):
            yield scan_one(path, label, tmp)


def table(outcomes: list[Outcome]) -> str:
    rows = ["kind              samples  detected  incident  fields_ok/labelled"]
    for kind in KINDS:
        group = [o for o in outcomes if o.kind == kind]
        if not group:
            continue
        fl = [w == g for o in group for (w, g) in o.fields.values()]
        rows.append(
            f"{kind:<17} {len(group):>7} {sum(o.detected for o in group):>9} "
            f"{sum(o.opened for o in group):>9}  {sum(fl)}/{len(fl)}"
        )
    neg = [o for o in outcomes if o.kind == "none"]
    rows.append(f"{'none (clean)':<17} {len(neg):>7} {sum(o.clean for o in neg):>9}")
    return "\n".join(rows)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    if not (REALLOGS / "labels.jsonl").exists():
        pytest.skip(f"{REALLOGS} not present")
    result = list(_outcomes(tmp_path_factory.mktemp("reallogs")))
    print("\n" + table(result))
    for o in result:
        bad = {k: v for k, v in o.fields.items() if v[0] != v[1]}
        if (
            (o.kind != "none" and not (o.detected and o.opened))
            or bad
            or (o.kind == "none" and not o.clean)
        ):
            print(
                f"  {o.file}: kinds={sorted({e['kind'] for e in o.events})} "
                f"incidents={[i['kind'] for i in o.incidents]} fields={bad}"
            )
    return result


def test_every_incident_sample_is_detected(outcomes: list[Outcome]) -> None:
    missed = [o.file for o in outcomes if o.kind != "none" and not o.detected]
    assert not missed


def test_nearly_all_open_an_incident(outcomes: list[Outcome]) -> None:
    incident = [o for o in outcomes if o.kind != "none"]
    opened = sum(o.opened for o in incident)
    assert opened >= 0.9 * len(incident), [o.file for o in incident if not o.opened]


def test_negatives_open_no_incident(outcomes: list[Outcome]) -> None:
    noisy = {o.file: [i["title"] for i in o.incidents] for o in outcomes if o.kind == "none"}
    assert not {k: v for k, v in noisy.items() if v}


def test_fields_agree_with_labels(outcomes: list[Outcome]) -> None:
    bad = {
        o.file: {k: v for k, v in o.fields.items() if v[0] != v[1]}
        for o in outcomes
        if any(w != g for w, g in o.fields.values())
    }
    assert not bad
