"""Events -> incidents with one root cause.

The correlator reads the events committed since its last pass, attaches each to an incident of
its run (grouped by a fingerprint of kind and normalised message), and recomputes what changed:
ranks, counts, the origin (the earliest occurrence), the title. Every material change bumps the
incident's ``version``; notification sinks are told through the outbox.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..events import now_utc
from ..store.db import Store
from .origin import origin_for

_NUM = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
_PATH = re.compile(r"(?:/[\w.\-]+)+")
_WS = re.compile(r"\s+")

# Kinds whose events of one run are always one incident, whatever their text.
_ONE_PER_RUN = {"nan", "oom", "process_failure", "slowdown", "data_issue"}


def fingerprint(kind: str, message: str, fields: Mapping[str, Any]) -> str:
    """Group key within a run: the kind, plus the normalised message for open-ended kinds."""
    if kind in _ONE_PER_RUN:
        return kind
    if kind in ("comm_timeout", "comm_error"):
        backend = str(fields.get("backend") or "")
        return f"{kind}:{backend}"
    text = _PATH.sub("<path>", message)
    text = _NUM.sub("<n>", text)
    text = _WS.sub(" ", text).strip().lower()[:160]
    return f"{kind}:{text}"


@dataclass
class Change:
    """A material change of an incident, for the outbox."""

    incident_id: int
    action: str  # open | update | resolve
    version: int
    news: list[str] = field(default_factory=list)  # what changed, for follow-ups


@dataclass
class _Acc:
    """What one pass learned about one incident."""

    incident: dict[str, Any]
    new_events: list[dict[str, Any]] = field(default_factory=list)
    created: bool = False


class Correlator:
    """Incremental: each pass handles the events committed since the previous one."""

    META_KEY = "correlated_upto"

    def __init__(self, store: Store) -> None:
        self.store = store

    def process(self) -> list[Change]:
        last = int(self.store.meta_get(self.META_KEY, "0") or 0)
        changes: list[Change] = []
        while True:
            batch = self.store.events_after(last, limit=20000)
            if not batch:
                break
            with self.store.transaction():
                changes.extend(self._apply(batch))
                last = batch[-1]["id"]
                self.store.meta_set(self.META_KEY, str(last))
        return changes

    # -- one batch -------------------------------------------------------------------------------

    def _apply(self, events: Iterable[dict[str, Any]]) -> list[Change]:
        accs: dict[int, _Acc] = {}
        for ev in events:
            if ev["fields"].get("incident") is False:
                continue  # kept as an event, not incident-worthy on its own (e.g. early overflow)
            key = fingerprint(ev["kind"], ev["message"], ev["fields"])
            inc = self._open_incident(ev["run_id"], key, accs)
            if inc is None:
                inc = self._create(ev, key)
                accs[inc["id"]] = _Acc(inc, created=True)
            acc = accs.setdefault(inc["id"], _Acc(inc))
            acc.new_events.append(ev)
        changes = []
        for acc in accs.values():
            ch = self._update(acc)
            if ch is not None:
                changes.append(ch)
        return changes

    def _open_incident(
        self, run_id: int, key: str, accs: Mapping[int, _Acc]
    ) -> dict[str, Any] | None:
        for acc in accs.values():
            inc = acc.incident
            if inc["run_id"] == run_id and inc["key"] == key and inc["status"] == "open":
                return inc
        row = self.store.conn.execute(
            "SELECT * FROM incidents WHERE run_id IS ? AND key=? AND status='open' "
            "ORDER BY id DESC LIMIT 1",
            (run_id, key),
        ).fetchone()
        return _incident(self.store, row) if row else None

    def _create(self, ev: Mapping[str, Any], key: str) -> dict[str, Any]:
        now = now_utc()
        run = self.store.conn.execute(
            "SELECT name, experiment FROM runs WHERE id IS ?", (ev["run_id"],)
        ).fetchone()
        cur = self.store.execute(
            "INSERT INTO incidents(run_id, kind, key, title, status, ranks, first_time, "
            "last_time, event_count, origin, hints, detail, root_event_id, version, created_at, "
            "updated_at) VALUES (?,?,?,?,'open','[]',?,?,0,'{}','[]','{}',?,0,?,?)",
            (
                ev["run_id"],
                ev["kind"],
                key,
                ev["message"][:200],
                ev["time"],
                ev["time"],
                ev["id"],
                now,
                now,
            ),
        )
        row = self.store.conn.execute(
            "SELECT * FROM incidents WHERE id=?", (cur.lastrowid,)
        ).fetchone()
        inc = _incident(self.store, row)
        inc["_run_name"] = run[0] if run else None
        return inc

    def _update(self, acc: _Acc) -> Change | None:
        inc = acc.incident
        iid = inc["id"]
        ids = [e["id"] for e in acc.new_events]
        self.store.conn.executemany(
            "UPDATE events SET incident_id=? WHERE id=?", [(iid, i) for i in ids]
        )
        ranks = set(inc["ranks"])
        for e in acc.new_events:
            if e.get("rank") is not None:
                ranks.add(e["rank"])
        times = [t for t in (inc["first_time"], inc["last_time"]) if t]
        times += [e["time"] for e in acc.new_events if e.get("time")]
        count = inc["event_count"] + len(acc.new_events)
        origin_ev, origin = origin_for(inc["kind"])(self.store.conn, iid)
        title = title_for(inc["kind"], origin_ev, inc.get("_run_name") or self._run_name(inc))
        news = []
        added = sorted(ranks - set(inc["ranks"]))
        if added and not acc.created:
            news.append("ranks " + ",".join(str(r) for r in added) + " affected")
        if inc["origin"] and _where(origin) != _where(inc["origin"]):
            news.append("origin moved to " + _where(origin))
        material = acc.created or bool(news) or title != inc["title"]
        version = inc["version"] + 1 if material else inc["version"]
        self.store.execute(
            "UPDATE incidents SET ranks=?, first_time=?, last_time=?, event_count=?, origin=?, "
            "title=?, root_event_id=?, version=?, updated_at=? WHERE id=?",
            (
                json.dumps(sorted(ranks)),
                min(times) if times else None,
                max(times) if times else None,
                count,
                json.dumps(origin),
                title,
                origin_ev["id"] if origin_ev else inc["root_event_id"],
                version,
                now_utc(),
                iid,
            ),
        )
        if not material:
            return None
        return Change(iid, "open" if acc.created else "update", version, news)

    def _run_name(self, inc: Mapping[str, Any]) -> str | None:
        row = self.store.conn.execute(
            "SELECT name FROM runs WHERE id IS ?", (inc["run_id"],)
        ).fetchone()
        return row[0] if row else None


def _where(origin: Mapping[str, Any]) -> str:
    parts = [f"{k} {origin[k]}" for k in ("rank", "step", "tensor") if origin.get(k) is not None]
    return ", ".join(parts)


def _incident(store: Store, row: Any) -> dict[str, Any]:
    d = store._row(row, "incidents")
    for k in ("ranks", "origin", "hints", "detail"):
        d[k] = json.loads(d[k] or ("[]" if k in ("ranks", "hints") else "{}"))
    return d


_KIND_TITLE = {
    "nan": "Non-finite values",
    "overflow": "Loss-scale overflow",
    "comm_timeout": "Collective communication timeout",
    "comm_error": "Collective communication error",
    "oom": "Out of memory",
    "process_failure": "Process failure",
    "slowdown": "Step time slowdown",
    "data_issue": "Training data issue",
}


def title_for(kind: str, ev: Mapping[str, Any] | None, run: str | None) -> str:
    parts = [_KIND_TITLE.get(kind, kind)]
    if ev is not None:
        where = []
        if ev.get("stage"):
            where.append(ev["stage"])
        if ev.get("rank") is not None:
            where.append(f"rank {ev['rank']}")
        if ev.get("epoch") is not None and ev.get("iter") is not None:
            where.append(f"epoch {ev['epoch']} iter {ev['iter']}")
        elif ev.get("step") is not None:
            where.append(f"step {ev['step']}")
        tensor = ev.get("fields", {}).get("tensor")
        if tensor and kind == "nan":
            parts[0] = f"{tensor} is {ev.get('fields', {}).get('value', 'non-finite')}"
        if where:
            parts.append("in " + ", ".join(where) if ev.get("stage") else ", ".join(where))
    if run:
        parts.append(f"(run {run})")
    return " ".join(parts)
