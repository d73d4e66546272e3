"""Causal chains: a root cause on one rank, symptoms on the others.

When a rank dies (out of memory, a crash), the other ranks wait in their next collective until
it times out: HCCL after ``HCCL_EXEC_TIMEOUT`` (1800 s by default), NCCL after the process
group's timeout (10 or 30 minutes, printed as ``Timeout(ms)=``). Those timeouts are symptoms.
A symptom joins a root when it names the root's rank (EI0002 ``remote rank [3]``), or when it
happened within one collective timeout (plus a margin) after the root.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..events import parse_utc

ROOT_KINDS = ("oom", "process_failure")  # in priority order: an OOM absorbs its process failure
SYMPTOM_KINDS = ("comm_timeout", "comm_error")
DEFAULT_TIMEOUT = {"hccl": 1800.0, "nccl": 1800.0, "gloo": 1800.0}
MARGIN_BEFORE = 300.0  # clocks of different nodes and log buffering


@dataclass(frozen=True)
class Timeouts:
    """Collective timeouts in force, from the config or the run's facts (seconds)."""

    hccl: float | None = None
    nccl: float | None = None

    def for_backend(self, backend: str | None, event_timeout_ms: Any = None) -> float:
        if isinstance(event_timeout_ms, (int, float)) and event_timeout_ms > 0:
            return float(event_timeout_ms) / 1000.0
        b = (backend or "").lower()
        if b == "hccl" and self.hccl:
            return self.hccl
        if b == "nccl" and self.nccl:
            return self.nccl
        return DEFAULT_TIMEOUT.get(b, 1800.0)

    def with_facts(self, facts: Mapping[str, Any]) -> Timeouts:
        """These (configured) timeouts, else those the run said were in force (its facts):
        ``HCCL_EXEC_TIMEOUT`` for HCCL; ``NCCL_TIMEOUT``, else the process group's timeout of
        an NCCL group, for NCCL."""
        told = facts.get("timeouts") if isinstance(facts, Mapping) else None
        if not isinstance(told, Mapping):
            return self
        hccl = self.hccl or _seconds(told.get("HCCL_EXEC_TIMEOUT"))
        nccl = self.nccl or _seconds(told.get("NCCL_TIMEOUT"))
        if not nccl and "nccl" in str(facts.get("backend") or ""):
            nccl = _seconds(told.get("pg_timeout"))
        return Timeouts(hccl, nccl)


def _seconds(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def event_time(ev: Mapping[str, Any]) -> float | None:
    """The event's own time, else the last time its stream printed (tracebacks have none)."""
    t = ev.get("time") or (ev.get("fields") or {}).get("stream_time")
    if not t:
        return None
    try:
        return parse_utc(str(t))
    except ValueError:
        return None


@dataclass(frozen=True)
class Root:
    incident_id: int
    kind: str
    rank: int | None
    ranks: frozenset[int]
    time: float | None


def roots_of_run(conn: sqlite3.Connection, run_id: int | None) -> list[Root]:
    """Open root-cause incidents of a run, earliest first, with their root event's time."""
    rows = conn.execute(
        "SELECT i.id, i.kind, i.origin, i.ranks FROM incidents i WHERE i.run_id IS ? "
        "AND i.status = 'open' AND i.kind IN ('oom', 'process_failure') ORDER BY i.id",
        (run_id,),
    ).fetchall()
    out = []
    for iid, kind, origin_json, ranks_json in rows:
        origin = json.loads(origin_json or "{}")
        t = origin.get("time")
        when = parse_utc(t) if t else None
        out.append(
            Root(iid, kind, origin.get("rank"), frozenset(json.loads(ranks_json or "[]")), when)
        )
    out.sort(key=lambda r: (ROOT_KINDS.index(r.kind), r.time or 0.0, r.incident_id))
    return out


def links(root: Root, ev: Mapping[str, Any], timeouts: Timeouts) -> bool:
    """Does symptom event ``ev`` follow from ``root``?"""
    fields = ev.get("fields") or {}
    remote = fields.get("remote_rank")
    if remote is not None and root.rank is not None:
        try:
            if int(remote) == root.rank or int(remote) in root.ranks:
                return True
        except (TypeError, ValueError):
            pass
    for failed in fields.get("failed_ranks") or ():
        if failed == root.rank:
            return True
    t = event_time(ev)
    if t is None or root.time is None:
        return True  # same run and nothing says otherwise: the one root explains it
    window = timeouts.for_backend(fields.get("backend"), fields.get("timeout_ms"))
    return root.time - MARGIN_BEFORE <= t <= root.time + window * 1.2 + MARGIN_BEFORE


def absorbs(root: Root, other: Root) -> bool:
    """An OOM absorbs the process failure of its own rank (the launcher reporting it died)."""
    if root.kind != "oom" or other.kind != "process_failure":
        return False
    if root.rank is not None and other.ranks and root.rank not in other.ranks:
        return False
    if root.time is None or other.time is None:
        return True
    return root.time - MARGIN_BEFORE <= other.time <= root.time + 3600.0
