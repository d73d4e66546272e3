"""Where an incident started: its origin block (ARCHITECTURE.md vocabulary).

``origin_for(kind)`` returns the function that computes an incident's origin from its events.
Kinds register their own (NaN localisation across ranks and tensor families has one); the
default takes the earliest event by (step, time, rank).

A caused incident (an OOM or a process failure that other ranks' timeouts follow from) takes its
origin from its root event: the event of the incident's own kind that happened first, never from
one of its symptoms, whatever their steps and times say. The root moves only on evidence (another
event of the root's kind known to be earlier); an equal or unknown time keeps the one chosen.

``origin.evidence`` (added when there is any) says why the origin's rank is the root:
``named_by``, the ranks whose communication failures named it as the peer they waited for
(HCCL ``remote rank [3]``, gloo's monitoredBarrier); for a process failure, the launcher's
``report`` with its ``exit_code`` and ``signal``. A communication incident without a root of its
own (the rank that failed left no line: SIGKILL from the host's OOM killer, a lost node) whose
failures name a rank that printed nothing in it takes that rank as its origin: ``origin.rank`` is
the silent rank, ``evidence.silent`` is true and ``evidence.first_seen_rank`` the rank whose
failure came first. The incident stays a communication incident: nothing says how that rank
ended, only that it stopped responding.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from ..store.db import Store
from ..store.records import EVENT_COLUMNS
from .chains import SYMPTOM_KINDS, event_time

OriginFn = Callable[[sqlite3.Connection, int], tuple[dict[str, Any] | None, dict[str, Any]]]
"""(connection, incident id) -> (the root event or None, the origin block)."""

_REGISTRY: dict[str, OriginFn] = {}


def register(kind: str) -> Callable[[OriginFn], OriginFn]:
    def deco(fn: OriginFn) -> OriginFn:
        _REGISTRY[kind] = fn
        return fn

    return deco


def origin_for(kind: str) -> OriginFn:
    return _REGISTRY.get(kind, earliest_event_origin)


def sort_key(ev: Mapping[str, Any]) -> tuple[Any, ...]:
    """Earliest first: known steps before unknown, then time, then rank, then arrival."""
    step = ev.get("step")
    return (
        0 if step is not None else 1,
        step if step is not None else 0,
        ev.get("time") or ev.get("fields", {}).get("stream_time") or "~",
        ev.get("rank") if ev.get("rank") is not None else 1 << 30,
        ev["id"],
    )


def earliest_event(
    conn: sqlite3.Connection, incident_id: int, kinds: tuple[str, ...] = ()
) -> dict[str, Any] | None:
    # the same order as sort_key, in SQL: an incident may hold thousands of events
    only = f" AND kind IN ({','.join('?' * len(kinds))})" if kinds else ""
    row = conn.execute(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id=?{only} "
        "ORDER BY step IS NULL, step, "
        "coalesce(time, json_extract(fields, '$.stream_time'), '~'), "
        "rank IS NULL, rank, id LIMIT 1",
        (incident_id, *kinds),
    ).fetchone()
    return Store._event(row) if row else None


def _root_key(ev: Mapping[str, Any], named: Mapping[int, Any]) -> tuple[Any, ...]:
    """Which of two events of the root's kind came first: an exit the launcher caused (SIGTERM)
    after any other; a known time before an unknown one, then the time (a traceback's is the
    last time its stream printed); at the same time, one on a rank the symptoms name as the
    peer they waited for (a launcher may report one exit by local rank and again by global
    rank), then the step; an event that says where it happened before one that does not."""
    t = event_time(ev)
    step = ev.get("step")
    located = ev.get("rank") is not None or ev.get("local_rank") is not None
    # a launcher stops the survivors with SIGTERM after it saw the first failure; its summary
    # lists them before that failure, all under one time
    stopped = (ev.get("fields") or {}).get("signal") == "SIGTERM"
    return (
        stopped,
        t is None,
        t or 0.0,
        ev.get("rank") not in named,
        step is None,
        step or 0,
        not located,
    )


def root_event(conn: sqlite3.Connection, incident_id: int) -> dict[str, Any] | None:
    """The incident's root: its first event of the incident's own kind. The one chosen before
    stays unless another is known to be earlier (ties and missing times keep it)."""
    row = conn.execute(
        "SELECT kind, root_event_id FROM incidents WHERE id = ?", (incident_id,)
    ).fetchone()
    if row is None:
        return None
    kind, held_id = row
    evs = [
        Store._event(r)
        for r in conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id = ? AND kind = ? ORDER BY id",
            (incident_id, kind),
        )
    ]
    if not evs:
        return earliest_event(conn, incident_id)
    named = _named(conn, incident_id)

    def key(e: Mapping[str, Any]) -> tuple[Any, ...]:
        return _root_key(e, named)

    best = min(evs, key=key)  # min keeps the first arrived of equals
    held = next((e for e in evs if e["id"] == held_id), None)
    if held is not None and not key(best) < key(held):
        return held
    return best


def origin_of(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The origin block of an incident rooted at one event."""
    f = ev.get("fields", {})
    extra = {k: f[k] for k in ("ratio", "baseline", "current", "against") if k in f}
    tensor = f.get("tensor")
    if "loss" in (f.get("tensors") or ()):
        tensor = "loss"  # a line with several non-finite terms: the total loss says it best
    return {
        **extra,
        "rank": ev.get("rank"),
        "step": ev.get("step"),
        "epoch": ev.get("epoch"),
        "iter": ev.get("iter"),
        "stage": ev.get("stage"),
        "phase": f.get("phase"),
        "tag": f.get("tag"),
        "tensor": tensor,
        "shape": f.get("shape"),
        "dtype": f.get("dtype"),
        "module": f.get("module"),
        "first_param": f.get("first_param"),
        "time": ev.get("time") or f.get("stream_time"),
        "event_id": ev.get("id"),
    }


def earliest_event_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    ev = earliest_event(conn, incident_id)
    return ev, (origin_of(ev) if ev else {})


def root_event_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    ev = root_event(conn, incident_id)
    if ev is None:
        return None, {}
    origin = origin_of(ev)
    evidence: dict[str, Any] = {}
    if origin["rank"] is not None:
        namers = _named(conn, incident_id).get(origin["rank"])
        if namers:
            evidence["named_by"] = sorted(namers)
    if ev["kind"] == "process_failure":
        f = ev.get("fields") or {}
        evidence["report"] = ev.get("message")
        evidence.update({k: f[k] for k in ("exit_code", "signal") if f.get(k) is not None})
    if evidence:
        origin["evidence"] = evidence
    return ev, origin


def comm_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """A communication incident's origin: its first failure; the rank they name, when that
    rank printed nothing in it (see the module docstring)."""
    ev = earliest_event(conn, incident_id, SYMPTOM_KINDS) or earliest_event(conn, incident_id)
    if ev is None:
        return None, {}
    origin = origin_of(ev)
    named = _named(conn, incident_id)
    spoke = {
        r
        for (r,) in conn.execute(
            "SELECT DISTINCT rank FROM events WHERE incident_id = ? AND rank IS NOT NULL",
            (incident_id,),
        )
    }
    silent = [r for r in named if r not in spoke]  # in the order they were first named
    if silent:
        rank = max(silent, key=lambda r: len(named[r]))  # max keeps the first of equals
        origin["evidence"] = {
            "named_by": sorted(named[rank]),
            "silent": True,
            "first_seen_rank": origin["rank"],
        }
        origin["rank"] = rank
    return ev, origin


def _named(conn: sqlite3.Connection, incident_id: int) -> dict[int, set[int]]:
    """{rank named as the peer waited for: the ranks that named it}, first named first."""
    out: dict[int, set[int]] = {}
    for remote, rank in conn.execute(
        "SELECT json_extract(fields, '$.remote_rank'), rank FROM events WHERE incident_id = ? "
        "AND kind IN ('comm_timeout', 'comm_error') "
        "AND json_extract(fields, '$.remote_rank') IS NOT NULL ORDER BY id",
        (incident_id,),
    ):
        try:
            named = int(remote)
        except (TypeError, ValueError):
            continue
        namers = out.setdefault(named, set())
        if rank is not None and rank != named:
            namers.add(rank)
    return out


for _kind in ("oom", "process_failure"):
    register(_kind)(root_event_origin)
for _kind in SYMPTOM_KINDS:
    register(_kind)(comm_origin)
