"""Slowdowns: a sustained rise of step time, against the run's own baseline or the previous run.

Step times come from the ``metrics`` table (training iterations only; validation is excluded).
Per logged step the median over ranks is taken, the first iterations (warm-up) are skipped,
and rolling medians absorb jitter. A run is slow when the median of a window of consecutive
steps is at least ``THRESHOLD`` times its baseline: the median of its own first steady steps,
or, when the whole run is slow from its start, the median of the previous run of the same
experiment (same work_dir / config name), even if the two were scanned separately.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from statistics import median
from typing import Any

from ..events import Event

THRESHOLD = 1.5
MIN_INCREASE = 0.05  # seconds per step: millisecond steps jitter by 50% without meaning much
MIN_POINTS = 6


def _slow(current: float, baseline: float) -> bool:
    return current >= THRESHOLD * baseline and current - baseline >= MIN_INCREASE


@dataclass(frozen=True)
class Point:
    step: int
    seconds: float
    source_id: int
    offset: int
    epoch: int | None
    iter: int | None
    time: str | None


def series(
    conn: sqlite3.Connection, run_id: int, cache: dict[int, list[Point]] | None = None
) -> list[Point]:
    """Median step time per logged training step (over ranks), in step order.

    Rows are read in the order of the ``metrics_run`` index (rank, step), with no sort and
    without holding them: a long run has millions. Within a step the ranks come in order, so
    the step's first row (its place) is its lowest rank's, as with ``ORDER BY step, rank``.
    ``cache`` keeps the series of one pass (a run is also its successor's baseline).
    """
    if cache is not None and run_id in cache:
        return cache[run_id]
    rows = conn.execute(
        "SELECT step, step_time, source_id, offset, epoch, iter, time FROM metrics "
        "WHERE run_id = ? AND stage = 'train' AND step_time IS NOT NULL AND step IS NOT NULL "
        "AND step_time > 0 ORDER BY rank, step",
        (run_id,),
    )
    seconds: dict[int, list[float]] = {}
    first: dict[int, tuple[Any, ...]] = {}
    for r in rows:
        got = seconds.get(r[0])
        if got is None:
            seconds[r[0]] = [r[1]]
            first[r[0]] = r
        else:
            got.append(r[1])
    out = [Point(step, median(seconds[step]), *first[step][2:]) for step in sorted(seconds)]
    if cache is not None:
        cache[run_id] = out
    return out


def steady(points: list[Point]) -> list[Point]:
    """Without warm-up: the first few logged steps (compilation, caches) are slower."""
    skip = max(2, len(points) // 20)
    return points[skip:] if len(points) > skip + MIN_POINTS - 2 else points[1:]


def window(n: int) -> int:
    return max(5, min(20, n // 5))


@dataclass(frozen=True)
class Finding:
    at: Point
    ratio: float
    baseline: float
    current: float
    against: str  # "own" or the previous run's name


def own_baseline_finding(points: list[Point]) -> Finding | None:
    pts = steady(points)
    if len(pts) < MIN_POINTS:
        return None
    k = window(len(pts))
    base = median(p.seconds for p in pts[:k])
    if base <= 0:
        return None
    for i in range(k, len(pts) - k + 1):
        cur = median(p.seconds for p in pts[i : i + k])
        if _slow(cur, base):
            # the first step of the slow stretch
            start = next((p for p in pts[i : i + k] if _slow(p.seconds, base)), pts[i])
            return Finding(start, cur / base, base, cur, "own")
    return None


def previous_run_finding(
    points: list[Point], previous: list[Point], previous_name: str
) -> Finding | None:
    pts, prev = steady(points), steady(previous)
    if len(pts) < MIN_POINTS or len(prev) < MIN_POINTS:
        return None
    base = median(p.seconds for p in prev)
    k = window(len(pts))
    cur = median(p.seconds for p in pts[:k])
    if base > 0 and _slow(cur, base):
        return Finding(pts[0], cur / base, base, cur, previous_name)
    return None


def previous_run(conn: sqlite3.Connection, run_id: int) -> tuple[int, str] | None:
    """The latest other run of the same experiment that started before this one."""
    row = conn.execute(
        "SELECT experiment, (SELECT min(time) FROM metrics WHERE run_id = runs.id) "
        "FROM runs WHERE id = ?",
        (run_id,),
    ).fetchone()
    if not row or not row[0] or not row[1]:
        return None
    experiment, start = row
    prev = conn.execute(
        "SELECT r.id, r.name FROM runs r WHERE r.experiment = ? AND r.id != ? AND "
        "(SELECT min(time) FROM metrics m WHERE m.run_id = r.id) < ? "
        "ORDER BY (SELECT min(time) FROM metrics m WHERE m.run_id = r.id) DESC LIMIT 1",
        (experiment, run_id, start),
    ).fetchone()
    return (int(prev[0]), str(prev[1])) if prev else None


def later_runs(conn: sqlite3.Connection, run_id: int) -> list[int]:
    """Runs of the same experiment that started after this one (they compare against it)."""
    rows = conn.execute(
        "SELECT r.id FROM runs r, runs me WHERE me.id = ? AND r.experiment = me.experiment "
        "AND r.id != me.id AND me.experiment IS NOT NULL",
        (run_id,),
    ).fetchall()
    return [int(r[0]) for r in rows]


def find(
    conn: sqlite3.Connection, run_id: int, cache: dict[int, list[Point]] | None = None
) -> Finding | None:
    points = series(conn, run_id, cache)
    if len(points) < MIN_POINTS:
        return None
    candidates = []
    prev = previous_run(conn, run_id)
    if prev is not None:
        f = previous_run_finding(points, series(conn, prev[0], cache), prev[1])
        if f is not None:
            candidates.append(f)
    f = own_baseline_finding(points)
    if f is not None:
        candidates.append(f)
    if not candidates:
        return None
    return min(candidates, key=lambda c: c.at.step)


def to_event(f: Finding) -> Event:
    if f.against == "own":
        why = f"than this run's own steady steps ({f.baseline:.3g} s)"
    else:
        why = f"than the previous run {f.against} ({f.baseline:.3g} s)"
    return Event(
        kind="slowdown",
        message=f"step time {f.current:.3g} s, {f.ratio:.1f}x slower {why}",
        offset=f.at.offset,
        key="slowdown",
        time=f.at.time,
        epoch=f.at.epoch,
        iter=f.at.iter,
        step=f.at.step,
        stage="train",
        fields={
            "ratio": round(f.ratio, 2),
            "baseline": round(f.baseline, 4),
            "current": round(f.current, 4),
            "against": f.against,
        },
    )
