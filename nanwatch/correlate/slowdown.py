"""Slowdowns: a sustained rise of step time, against the run's own baseline or the previous run.

Step times are training iterations' (validation is excluded), read once: each pass feeds only
the metric blocks stored since the last one into rolling statistics kept per (run, rank) in
the store (``step_stats``), so a long run's history is never read again.

Per rank: the first ``SKIP`` logged steps (warm-up: compilation, caches) are skipped, the
median of the next ``WINDOW`` is the rank's baseline, and a rolling window of the last
``WINDOW`` steps after it is slow when its median is at least ``THRESHOLD`` times the baseline
(and ``MIN_INCREASE`` seconds above it): at least half of the window is at or above that
mark, which a running count tells without sorting. A run is slow when most of its ranks are;
its finding is the one by whose step that majority was slow. When the whole run is slow from
its start, its baseline is compared with the previous run of the same experiment (same
work_dir / config name), even if the two were scanned separately.
A step a rank already logged (the same lines in the log file and the captured stdout) counts
once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import field
from functools import partial
from itertools import compress, islice, repeat
from operator import eq, lt
from typing import NamedTuple, cast

from .._dc import dataclass
from ..events import Event
from ..store.metrics import MISSING, Block, Metrics
from ..store.records import JSON

THRESHOLD = 1.5
MIN_INCREASE = 0.05  # seconds per step: millisecond steps jitter by 50% without meaning much
SKIP = 2  # warm-up steps
WINDOW = 9  # steps in the baseline and in the rolling window (odd: its median is one of them)
META_KEY = "slowdown_blocks_upto"


def median(xs: Iterable[float]) -> float:
    """``statistics.median``, without the import (decimal, fractions, random) at every start."""
    s = sorted(xs)
    if not s:
        raise ValueError("median of no data")
    i = len(s) // 2
    return s[i] if len(s) % 2 else (s[i - 1] + s[i]) / 2


def _mark(baseline: float) -> float:
    """The step time from which a step counts as slow against ``baseline``."""
    return max(THRESHOLD * baseline, baseline + MIN_INCREASE)


class Point(NamedTuple):
    """A logged training step (a tuple: a scan makes one per iteration line)."""

    step: int
    seconds: float
    source_id: int | None
    offset: int
    epoch: int | None
    iter: int | None
    time: str | None

    def to_json(self) -> list[JSON]:
        return list(self)

    @classmethod
    def from_json(cls, v: list[JSON]) -> Point:
        return cls(*v)


@dataclass(frozen=True)
class Finding:
    at: Point
    ratio: float
    baseline: float
    current: float
    against: str  # "own" or the previous run's name


@dataclass
class RankStats:
    """One rank's rolling statistics (what ``step_stats`` keeps as JSON)."""

    last: int | None = None  # the highest step taken
    warm: list[float] = field(default_factory=list)  # the first SKIP + WINDOW step times
    first: Point | None = None  # the first step after the warm-up
    base: float | None = None
    window: list[Point] = field(default_factory=list)  # the last WINDOW steps after the baseline
    found: Finding | None = None

    def add(self, p: Point) -> None:
        if self.last is not None and p.step <= self.last:
            return  # logged already (another copy of the same lines) or out of order
        self.last = p.step
        if self.found is not None:
            return
        if self.base is None:
            self.warm.append(p.seconds)
            if len(self.warm) == SKIP + 1:
                self.first = p
            if len(self.warm) == SKIP + WINDOW:
                self.base = median(self.warm[SKIP:])
            return
        self.window.append(p)
        if len(self.window) > WINDOW:
            del self.window[0]
        if len(self.window) < WINDOW:
            return
        mark = _mark(self.base)
        # only a slow step can make the window slow: the others need no count
        if p.seconds >= mark and sum(1 for q in self.window if q.seconds >= mark) * 2 > WINDOW:
            cur = median(q.seconds for q in self.window)
            start = next(q for q in self.window if q.seconds >= mark)
            self.found = Finding(start, cur / self.base, self.base, cur, "own")

    def to_json(self) -> JSON:
        f = self.found
        return {
            "last": self.last,
            "warm": self.warm if self.base is None else [],
            "first": self.first.to_json() if self.first else None,
            "base": self.base,
            "window": [] if f else [q.to_json() for q in self.window],
            "found": [f.at.to_json(), f.ratio, f.baseline, f.current] if f else None,
        }

    @classmethod
    def from_json(cls, v: Mapping[str, JSON]) -> RankStats:
        f = v.get("found")
        return cls(
            last=v.get("last"),
            warm=list(v.get("warm") or []),
            first=Point.from_json(v["first"]) if v.get("first") else None,
            base=v.get("base"),
            window=[Point.from_json(q) for q in v.get("window") or []],
            found=Finding(Point.from_json(f[0]), f[1], f[2], f[3], "own") if f else None,
        )


def feed(stats: dict[int, RankStats], block: Block) -> None:
    """Take a block's training step times into its run's per-rank statistics.

    Row by row this is :meth:`RankStats.add` (the reference, :func:`feed_rows`); past a
    rank's warm-up the rows go through :func:`_add_many`, which keeps the rolling window as
    (seconds, row) pairs with a running count of slow steps and makes a :class:`Point` only
    for the rows the window ends with (a scan stores hundreds of thousands of steps, and a
    Point and a method call per step were most of what storing them cost)."""
    c = block.columns
    n = len(c)
    if not n:
        return
    # the rows it takes (training, a step, a positive time), whole columns at a time: a
    # scan's blocks hold thousands of rows and most take every one
    rows: Sequence[int] = range(n)
    stage, steps, secs, ranks = c.stage, c.step, c.step_time, c.rank
    if stage.count("train") != n:
        rows = list(compress(rows, map(eq, repeat(_TRAIN), stage)))
    if None in steps:
        rows = [i for i in rows if steps[i] is not None]
    if None in secs:
        rows = [i for i in rows if secs[i] is not None]
    if not all(map(_POSITIVE, map(secs.__getitem__, rows))):
        rows = [i for i in rows if cast("float", secs[i]) > 0]
    if not rows:
        return
    per: dict[int, Sequence[int]]
    first = ranks[rows[0]]
    if ranks.count(first) == n:
        per = {MISSING if first is None else first: rows}
    else:
        per = {}
        for i in rows:
            rank = ranks[i]
            key = MISSING if rank is None else rank
            got = per.get(key)
            if got is None:
                got = per[key] = []
            cast("list[int]", got).append(i)
    for key, sel in per.items():
        st = stats.get(key)
        if st is None:
            st = stats[key] = RankStats()
        _add_many(st, block, sel)


_TRAIN = "train"
_POSITIVE = partial(lt, 0.0)  # False for NaN, as ``not sec > 0`` is


def feed_rows(stats: dict[int, RankStats], block: Block) -> None:
    """:func:`feed`, one :class:`Point` and one :meth:`RankStats.add` per row (the reference
    the bulk path is tested against)."""
    c = block.columns
    for rank, step, stage, sec, offset, epoch, it, when in zip(
        c.rank, c.step, c.stage, c.step_time, c.offset, c.epoch, c.iter, c.time
    ):
        if stage != "train" or step is None or sec is None or not sec > 0:
            continue
        key = MISSING if rank is None else rank
        st = stats.get(key)
        if st is None:
            st = stats[key] = RankStats()
        st.add(Point(step, sec, block.source_id, offset, epoch, it, when))


def _point(block: Block, i: int) -> Point:
    """Row ``i`` of a block (one :func:`feed` chose: its step and step time are known)."""
    c = block.columns
    step, sec = c.step[i], c.step_time[i]
    assert step is not None and sec is not None
    return Point(step, sec, block.source_id, c.offset[i], c.epoch[i], c.iter[i], c.time[i])


def _add_many(st: RankStats, block: Block, rows: Sequence[int]) -> None:
    """``st.add`` of every row in ``rows`` (indexes into the block's columns), in order."""
    n = len(rows)
    k = 0
    while k < n and st.base is None and st.found is None:  # warm-up: row by row
        st.add(_point(block, rows[k]))
        k += 1
    if k >= n:
        return
    # the rows feed chose have both (a cast, not a check per row)
    steps = cast("Sequence[int]", block.columns.step)
    secs = cast("Sequence[float]", block.columns.step_time)
    last = st.last
    if st.found is None:
        assert st.base is not None
        mark = _mark(st.base)
        sel = rows[k:]
        s_sel = list(map(steps.__getitem__, sel))
        if (
            (last is None or s_sel[0] > last)
            and all(map(lt, s_sel, islice(s_sel, 1, None)))
            and max(map(secs.__getitem__, sel)) < mark
        ):
            # the usual block: in order and nothing slow, so no window can turn slow (a slow
            # window needs a slow step to end it): the window is the last WINDOW steps
            st.window = [*st.window, *(_point(block, i) for i in sel[-WINDOW:])][-WINDOW:]
            st.last = s_sel[-1]
            return
        # the window: (seconds, Point of an earlier block, or this block's row index)
        win: deque[tuple[float, Point | int]] = deque((q.seconds, q) for q in st.window)
        slow = sum(1 for sec, _ in win if sec >= mark)
        while k < n:
            i = rows[k]
            k += 1
            step = steps[i]
            if last is not None and step <= last:
                continue
            last = step
            sec = secs[i]
            win.append((sec, i))
            if sec >= mark:
                slow += 1
            if len(win) > WINDOW and win.popleft()[0] >= mark:
                slow -= 1
            if len(win) == WINDOW and sec >= mark and slow * 2 > WINDOW:
                window = [q if isinstance(q, Point) else _point(block, q) for _, q in win]
                cur = median(q.seconds for q in window)
                start = next(q for q in window if q.seconds >= mark)
                st.window = window
                st.found = Finding(start, cur / st.base, st.base, cur, "own")
                break
        else:
            st.window = [q if isinstance(q, Point) else _point(block, q) for _, q in win]
    for i in rows[k:]:  # found: only the highest step moves on
        step = steps[i]
        if last is None or step > last:
            last = step
    st.last = last


class Tracker:
    """The rolling statistics of every run, brought up to date from the store's new blocks."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._stats: dict[int, dict[int, RankStats]] = {}

    def stats(self, run_id: int) -> dict[int, RankStats]:
        got = self._stats.get(run_id)
        if got is None:
            saved = self.metrics.rolling_state(run_id)
            got = self._stats[run_id] = {r: RankStats.from_json(s) for r, s in saved.items()}
        return got

    def update(self) -> list[tuple[int, Finding]]:
        """Feed the blocks stored since the last update (in the caller's transaction); the
        findings of the runs that moved on and of the runs compared with them."""
        store = self.metrics.store
        upto = int(store.meta_get(META_KEY, "0") or 0)
        newest = self.metrics.last_block()
        if newest <= upto:
            return []
        moved: set[int] = set()
        for block in self.metrics.blocks_after(upto):
            if block.run_id is None:
                continue
            feed(self.stats(block.run_id), block)
            moved.add(block.run_id)
        for run_id in sorted(moved):
            self.metrics.save_rolling_state(
                run_id, {r: s.to_json() for r, s in self.stats(run_id).items()}
            )
        store.meta_set(META_KEY, str(newest))
        runs = set(moved)
        for run_id in moved:
            runs.update(self.metrics.later_runs(run_id))
        out = []
        for run_id in sorted(runs):
            f = self.find(run_id)
            if f is not None:
                out.append((run_id, f))
        return out

    def find(self, run_id: int) -> Finding | None:
        ranks = [s for s in self.stats(run_id).values() if s.base is not None]
        if not ranks:
            return None
        prev = self.metrics.previous_run(run_id)
        prev_base: float | None = None
        if prev is not None:
            bases = [s.base for s in self.stats(prev[0]).values() if s.base is not None]
            prev_base = median(bases) if bases else None
        found: list[Finding] = []
        for s in ranks:
            assert s.base is not None
            if prev is not None and prev_base and s.first and s.base >= _mark(prev_base):
                found.append(Finding(s.first, s.base / prev_base, prev_base, s.base, prev[1]))
            elif s.found is not None:
                found.append(s.found)
        need = len(ranks) // 2 + 1  # most ranks
        if len(found) < need:
            return None
        found.sort(key=lambda f: (f.at.step, f.at.offset))
        return found[need - 1]


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
