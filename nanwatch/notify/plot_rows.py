"""The rows `nanwatch plot` draws: metrics of an incident's run around its origin, its
baseline run's for a slowdown, and the allocator's numbers for an out-of-memory incident.

Frozen :class:`PlotRow` records, one per logged iteration (``series`` tells which run, or
``"oom"``), so that the Slack sink can read them with the store open and draw them later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .._dc import dataclass
from ..store.db import Store
from ..store.events import Events
from ..store.incidents import Incidents
from ..store.metrics import Metrics
from ..store.runs import Runs

BEFORE = 200  # steps shown before the origin
AFTER = 100
LIMIT = 50000  # rows per series


@dataclass(frozen=True, slots=True)
class PlotRow:
    """One point of a plot: a logged iteration's numbers, or (``series="oom"``) what the
    allocator said when it failed, in MiB like mmengine's ``memory``."""

    series: str  # "current", "baseline" or "oom"
    rank: int | None
    step: int | None
    stage: str | None
    time: str | None
    loss: float | None = None
    grad_norm: float | None = None
    step_time: float | None = None
    data_time: float | None = None
    memory: float | None = None
    allocated: float | None = None
    reserved: float | None = None
    total: float | None = None
    bytes_requested: float | None = None

    def value(self, column: str) -> float | None:
        v: float | None = getattr(self, column)
        return v


def metrics_for(store: Store, incident: Mapping[str, Any]) -> list[PlotRow]:
    """Metric rows of the incident's run around its origin (every rank, every stage), and for a
    slowdown measured against another run, that run's training rows over the same steps
    (``series`` is ``"baseline"`` on those, ``"current"`` on the others)."""
    iid = incident.get("id")
    inc = Incidents(store).get(int(iid)) if isinstance(iid, int) else None
    if inc is None or inc.run_id is None:
        return []
    run_id = inc.run_id
    metrics = Metrics(store)
    origin = incident.get("origin") or {}
    step = origin.get("step")
    if step is None:
        last = metrics.last_step(run_id)
        if last is None:
            return []
        lo, hi = last - BEFORE - AFTER, last
    else:
        lo, hi = step - BEFORE, step + AFTER
    out = _rows(metrics, run_id, lo, hi, "current", train_only=False)
    if incident.get("kind") == "oom":
        out += _oom_row(store, incident)
    against = origin.get("against")
    if incident.get("kind") == "slowdown" and against and against != "own":
        base = Runs(store).by_name(str(against))
        if base is not None and base.id != run_id:
            out += _rows(metrics, base.id, lo, hi, "baseline", train_only=True)
    return out


def _rows(
    metrics: Metrics, run_id: int, lo: int, hi: int, series: str, *, train_only: bool
) -> list[PlotRow]:
    got = [
        PlotRow(
            series,
            m.rank,
            m.step,
            m.stage,
            m.time,
            m.loss,
            m.grad_norm,
            m.step_time,
            m.data_time,
            m.memory,
        )
        for m in metrics.rows([run_id], step_lo=lo, step_hi=hi)
        if not train_only or m.stage in (None, "train")
    ]
    # by rank, then step (ties in the order they were stored), as the lines are drawn
    got.sort(key=lambda r: (r.rank is not None, r.rank or 0, r.step or 0))
    return got[:LIMIT]


def _oom_row(store: Store, incident: Mapping[str, Any]) -> list[PlotRow]:
    """What the allocator said when it failed (``series`` ``"oom"``), in MiB like mmengine's
    ``memory``: allocated, requested, device total."""
    origin = incident.get("origin") or {}
    eid = origin.get("event_id")
    ev = Events(store).get(int(eid)) if isinstance(eid, int) else None
    if ev is None or ev.kind != "oom":
        return []
    fields = ev.fields
    mib = {
        k: fields[k] / 2**20
        for k in ("allocated", "reserved", "total", "bytes_requested")
        if isinstance(fields, dict) and finite(fields.get(k))
    }
    if "allocated" not in mib:
        return []
    return [PlotRow("oom", ev.rank, ev.step, ev.stage, origin.get("time"), **mib)]


def finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
