"""Per-iteration metrics as columnar blocks: one ``metric_blocks`` row per (source, chunk).

A catch-up scan logs hundreds of thousands of iterations; a row (and two index entries) per
iteration made storing them the costliest part of a scan and reading one run's step times
back a walk over millions of rows. A block holds one chunk's iterations as packed columns,
written in the same transaction as the chunk's offset (invariant 2), with the few summaries
readers filter on (offsets, steps, ranks, times) as plain columns beside it.

This module holds :class:`Metrics`, the one API the other stages use (its readers: the
slowdown check, plots, ``show``, merges, the ``metrics`` command), and migration 5, which
made the blocks. The rest is split by what it does:

- ``metric_codec``: the block's bytes (packing and unpacking the columns);
- ``metric_blocks``: a block's summary columns, and how a small block grows in place;
- ``metric_writer``: the insert paths (exactly once per logged iteration, the source's last
  block grown while it is small).
"""

from __future__ import annotations

import json
import sqlite3
from array import array
from collections.abc import Iterator, Sequence
from functools import partial
from itertools import compress
from operator import gt, is_not
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .._dc import dataclass
from .metric_blocks import SMALL_BLOCK, Packed, _finite, _summary, pack, trained_rows
from .metric_codec import (
    _SWAP,
    MISSING,
    MetricColumns,
    _raw_ints,
    _sections,
    _untexts,
    decode,
    encode,
    unpacked,
)
from .metric_writer import _INSERT_BLOCK, MetricWriter
from .records import JSON, MetricRow

if TYPE_CHECKING:
    from .db import Store

__all__ = [
    "BLOCK_ROWS",
    "MISSING",
    "SMALL_BLOCK",
    "Block",
    "MetricColumns",
    "Metrics",
    "Packed",
    "StepTimes",
    "decode",
    "encode",
    "pack",
    "rows_to_blocks",
    "unpacked",
]

BLOCK_ROWS = 4096  # rows per block when rows are converted (migration 5)


@dataclass(frozen=True, slots=True)
class Block:
    """One stored block: its run and source, and its iterations."""

    id: int
    run_id: int | None
    source_id: int | None
    columns: MetricColumns


@dataclass(frozen=True, slots=True)
class StepTimes:
    """One run's training step times (``stage = train``, step and a positive time known), in
    the order they were stored; ``rank`` is ``MISSING`` when the line had none."""

    rank: Sequence[int]
    step: Sequence[int]
    seconds: Sequence[float]


def _trained_below(c: MetricColumns, step: int) -> int | None:
    """The highest step below ``step`` of a block's training rows with a finite loss."""
    known = cast("Iterator[int]", filter(partial(is_not, None), compress(c.step, trained_rows(c))))
    return max(filter(partial(gt, step), known), default=None)


# -- the repository --------------------------------------------------------------------------


class Metrics(MetricWriter):
    """The ``metric_blocks`` table family of one :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._conn = store._conn

    @classmethod
    def reading(cls, conn: sqlite3.Connection) -> Metrics:
        """A reader over a connection a sink was handed (the outbox gives sinks connections)."""
        from .db import Store

        return cls(Store(Store.last_opened or Path(), conn, readonly=True))

    # -- reading -----------------------------------------------------------------------------

    def last_block(self) -> int:
        """The highest block id (0: none); block ids only grow."""
        row = self._conn.execute("SELECT coalesce(max(id), 0) FROM metric_blocks").fetchone()
        return int(row[0])

    def count(self) -> int:
        """How many iterations are stored."""
        return int(
            self._conn.execute("SELECT coalesce(sum(n), 0) FROM metric_blocks").fetchone()[0]
        )

    def blocks_after(self, block_id: int) -> Iterator[Block]:
        """Blocks stored after ``block_id``, in the order they were stored."""
        cur = self._conn.execute(
            "SELECT id, run_id, source_id, data FROM metric_blocks WHERE id > ? ORDER BY id",
            (block_id,),
        )
        for bid, run_id, source_id, blob in cur:
            yield Block(int(bid), run_id, source_id, unpacked(blob))

    def blocks(
        self,
        run_id: int | None = None,
        *,
        rank: int | None = None,
        step_lo: int | None = None,
        step_hi: int | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> Iterator[Block]:
        """Blocks that may hold iterations matching the filters (rows are filtered by the caller
        or :meth:`rows`), run by run in the order they were stored."""
        where, args = self._where(run_id, rank, step_lo, step_hi, since, until)
        cur = self._conn.execute(
            f"SELECT id, run_id, source_id, data FROM metric_blocks {where} ORDER BY run_id, id",
            args,
        )
        for bid, rid, sid, blob in cur:
            yield Block(int(bid), rid, sid, unpacked(blob))

    @staticmethod
    def _where(
        run_id: int | None,
        rank: int | None,
        step_lo: int | None,
        step_hi: int | None,
        since: str | None,
        until: str | None,
    ) -> tuple[str, list[object]]:
        conds: list[str] = []
        args: list[object] = []
        for cond, value in (
            ("run_id = ?", run_id),
            ("rank_min <= ? ", rank),
            ("rank_max >= ?", rank),
            ("step_max >= ?", step_lo),
            ("step_min <= ?", step_hi),
            ("time_max >= ?", since),
            ("time_min <= ?", until),
        ):
            if value is not None:
                conds.append(cond)
                args.append(value)
        return ("WHERE " + " AND ".join(conds) if conds else ""), args

    def rows(
        self,
        run_ids: Sequence[int] | None = None,
        *,
        runs: Sequence[str] | None = None,
        rank: int | None = None,
        since: str | None = None,
        until: str | None = None,
        step_lo: int | None = None,
        step_hi: int | None = None,
    ) -> Iterator[MetricRow]:
        """Every stored iteration matching the filters, run by run in the order they were stored
        (file by file, oldest first). ``since``/``until`` compare with the line's time."""
        names: dict[int, str] = dict(self._conn.execute("SELECT id, name FROM runs"))
        if runs is not None:
            wanted = set(runs)
            run_ids = [*(run_ids or ()), *(i for i, n in names.items() if i and n in wanted)]
        for run_id in (None,) if run_ids is None else run_ids:
            for b in self.blocks(
                run_id, rank=rank, step_lo=step_lo, step_hi=step_hi, since=since, until=until
            ):
                name = names.get(b.run_id) if b.run_id is not None else None
                for m in b.columns.rows():
                    if rank is not None and m.rank != rank:
                        continue
                    if step_lo is not None and (m.step is None or m.step < step_lo):
                        continue
                    if step_hi is not None and (m.step is None or m.step > step_hi):
                        continue
                    if since is not None and (m.time is None or m.time < since):
                        continue
                    if until is not None and (m.time is None or m.time > until):
                        continue
                    yield MetricRow(name, b.run_id, b.source_id, *m)

    def run_names(self) -> list[str]:
        """Every run's name, oldest first (what ``--run`` patterns are matched against)."""
        return [str(n) for (n,) in self._conn.execute("SELECT name FROM runs ORDER BY id")]

    def step_times(self, run_id: int, rank: int | None = None) -> StepTimes:
        """One run's training step times, decoding only the columns they need."""
        ranks: array[int] = array("q")
        steps: array[int] = array("q")
        seconds: array[float] = array("d")
        where, args = self._where(run_id, rank, None, None, None, None)
        for (blob,) in self._conn.execute(
            f"SELECT data FROM metric_blocks {where} ORDER BY id", args
        ):
            n, raw = _sections(blob)
            stage_raw, step_raw, time_raw = raw[5], raw[2], raw[9]
            if not step_raw or not time_raw:
                continue  # no step or no step time in this block
            r = _raw_ints(raw[1], n)
            s = _raw_ints(step_raw, n)
            t = array("d")
            t.frombytes(time_raw)
            if _SWAP:
                t.byteswap()
            total = sum(t)  # NaN (a missing time) makes it NaN
            if (
                stage_raw == b"=train"
                and MISSING not in s
                and _finite(total)
                and min(t) > 0
                and (rank is None or (min(r) == rank == max(r)))
            ):
                # the usual block, every row a training step with its time: whole columns
                ranks.extend(r)
                steps.extend(s)
                seconds.extend(t)
                continue
            stage = _untexts(stage_raw, n)
            for i in range(n):
                sec = t[i]
                if (
                    stage[i] == "train"
                    and sec > 0
                    and s[i] != MISSING
                    and (rank is None or r[i] == rank)
                ):
                    ranks.append(r[i])
                    steps.append(s[i])
                    seconds.append(sec)
        return StepTimes(ranks, steps, seconds)

    def first_time(self, run_id: int) -> str | None:
        """The earliest time an iteration line of the run printed."""
        row = self._conn.execute(
            "SELECT min(time_min) FROM metric_blocks WHERE run_id = ?", (run_id,)
        ).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def trained_to(self, run_id: int) -> tuple[int | None, int | None]:
        """(highest step, highest epoch) the run trained: a training iteration whose loss is
        finite (a NaN loss is missing)."""
        row = self._conn.execute(
            "SELECT max(trained_step_max), max(trained_epoch_max) FROM metric_blocks "
            "WHERE run_id = ?",
            (run_id,),
        ).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def trained_after(self, run_id: int | None, step: int) -> int:
        """How many training iterations with a finite loss the run logged after ``step``."""
        n = 0
        for b in self._trained(run_id, "trained_step_max > ?", step):
            c = b.columns
            n += sum(1 for s in compress(c.step, trained_rows(c)) if s is not None and s > step)
        return n

    def trained_before(self, run_id: int, step: int) -> int | None:
        """The last step before ``step`` the run trained with a finite loss."""
        # a block whose highest trained step is below ``step`` answers with that step; only
        # the blocks that also trained at or past it have their rows read
        row = self._conn.execute(
            "SELECT max(trained_step_max) FROM metric_blocks WHERE run_id IS ? "
            "AND trained_step_max < ?",
            (run_id, step),
        ).fetchone()
        best: int | None = None if row is None or row[0] is None else int(row[0])
        for b in self._trained(run_id, "step_min < ? AND trained_step_max >= ?2", step):
            got = _trained_below(b.columns, step)
            if got is not None and (best is None or got > best):
                best = got
        return best

    def _trained(self, run_id: int | None, cond: str, step: int) -> Iterator[Block]:
        cur = self._conn.execute(
            f"SELECT id, run_id, source_id, data FROM metric_blocks WHERE run_id IS ? AND {cond} "
            "AND trained_step_max IS NOT NULL ORDER BY id",
            (run_id, step),
        )
        for bid, rid, sid, blob in cur:
            yield Block(int(bid), rid, sid, unpacked(blob))

    def last_step(self, run_id: int) -> int | None:
        row = self._conn.execute(
            "SELECT max(step_max) FROM metric_blocks WHERE run_id = ?", (run_id,)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def runs_after(self, block_id: int) -> set[int]:
        """Runs that got iterations after ``block_id``."""
        return {
            int(r[0])
            for r in self._conn.execute(
                "SELECT DISTINCT run_id FROM metric_blocks WHERE id > ? AND run_id IS NOT NULL",
                (block_id,),
            )
        }

    def previous_run(self, run_id: int) -> tuple[int, str] | None:
        """The latest other run of the same experiment whose iterations started before this
        one's (the baseline of a run slow from its start)."""
        row = self._conn.execute(
            "SELECT experiment, (SELECT min(time_min) FROM metric_blocks WHERE run_id = runs.id) "
            "FROM runs WHERE id = ?",
            (run_id,),
        ).fetchone()
        if not row or not row[0] or not row[1]:
            return None
        prev = self._conn.execute(
            "SELECT id, name, t FROM (SELECT r.id, r.name, (SELECT min(m.time_min) FROM "
            "metric_blocks m WHERE m.run_id = r.id) AS t FROM runs r WHERE r.experiment = ? "
            "AND r.id != ?) WHERE t < ? ORDER BY t DESC LIMIT 1",
            (row[0], run_id, row[1]),
        ).fetchone()
        return (int(prev[0]), str(prev[1])) if prev else None

    def later_runs(self, run_id: int) -> list[int]:
        """The other runs of the same experiment (they may compare with this one)."""
        rows = self._conn.execute(
            "SELECT r.id FROM runs r, runs me WHERE me.id = ? AND r.experiment = me.experiment "
            "AND r.id != me.id AND me.experiment IS NOT NULL",
            (run_id,),
        ).fetchall()
        return [int(r[0]) for r in rows]

    # -- state of the slowdown check (per run and rank) --------------------------------------

    def rolling_state(self, run_id: int) -> dict[int, JSON]:
        """The slowdown check's rolling statistics of the run, per rank (``MISSING``: none)."""
        return {
            int(rank): json.loads(state)
            for rank, state in self._conn.execute(
                "SELECT rank, state FROM step_stats WHERE run_id = ?", (run_id,)
            )
        }

    def save_rolling_state(self, run_id: int, states: dict[int, JSON]) -> None:
        self._conn.executemany(
            "INSERT INTO step_stats(run_id, rank, state) VALUES (?, ?, ?) "
            "ON CONFLICT(run_id, rank) DO UPDATE SET state = excluded.state",
            [(run_id, r, json.dumps(s, separators=(",", ":"))) for r, s in states.items()],
        )

    # -- retention ---------------------------------------------------------------------------

    def expire(self, upto_block: int, *, limit: int = 64) -> int:
        """Delete blocks up to ``upto_block``, oldest first; returns how many iterations went."""
        return self._delete(
            "SELECT id FROM metric_blocks WHERE id <= ? ORDER BY id LIMIT ?", (upto_block, limit)
        )

    def trim_oldest(self, *, limit: int = 64) -> int:
        """Delete the oldest blocks (over the size cap); returns how many iterations went."""
        return self._delete("SELECT id FROM metric_blocks ORDER BY id LIMIT ?", (limit,))

    def _delete(self, select: str, args: tuple[int, ...]) -> int:
        with self.store.transaction():
            ids = [r[0] for r in self._conn.execute(select, args)]
            if not ids:
                return 0
            marks = ",".join("?" * len(ids))
            gone = self._conn.execute(
                f"SELECT coalesce(sum(n), 0) FROM metric_blocks WHERE id IN ({marks})", ids
            ).fetchone()[0]
            self.store.execute(f"DELETE FROM metric_blocks WHERE id IN ({marks})", ids)
        return int(gone)


# -- migration 5 -----------------------------------------------------------------------------


def rows_to_blocks(conn: sqlite3.Connection) -> None:
    """Migration 5: the ``metrics`` table's rows become blocks of up to BLOCK_ROWS iterations
    per source (in offset order), then the table goes. Marks that counted metric row ids
    (retention, slowdown, merge) restart from the block ids. Block ids are never reused
    (AUTOINCREMENT): those marks say "everything up to this block", even after retention
    deleted the newest ones."""
    conn.execute(
        """CREATE TABLE metric_blocks (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id INTEGER REFERENCES runs(id),
            source_id INTEGER REFERENCES sources(id),
            first_offset INTEGER NOT NULL,
            last_offset INTEGER NOT NULL,
            n INTEGER NOT NULL,
            rank_min INTEGER,
            rank_max INTEGER,
            step_min INTEGER,
            step_max INTEGER,
            time_min TEXT,
            time_max TEXT,
            trained_step_max INTEGER,
            trained_epoch_max INTEGER,
            data BLOB NOT NULL
        )"""
    )
    conn.execute(
        "CREATE UNIQUE INDEX metric_blocks_identity ON metric_blocks(source_id, first_offset)"
    )
    conn.execute("CREATE INDEX metric_blocks_end ON metric_blocks(source_id, last_offset)")
    conn.execute("CREATE INDEX metric_blocks_run ON metric_blocks(run_id, id)")
    conn.execute(
        "CREATE TABLE step_stats (run_id INTEGER NOT NULL, rank INTEGER NOT NULL, "
        "state TEXT NOT NULL, PRIMARY KEY (run_id, rank))"
    )
    cur = conn.execute(
        "SELECT run_id, source_id, offset, rank, step, epoch, iter, stage, time, loss, "
        "grad_norm, step_time, data_time, lr, memory FROM metrics ORDER BY source_id, offset"
    )
    key: tuple[object, object] | None = None
    rows: list[tuple[object, ...]] = []

    def flush() -> None:
        if rows and key is not None:
            cols = MetricColumns.from_rows(rows)
            conn.execute(
                _INSERT_BLOCK,
                (key[0], key[1], *_summary(cols), encode(cols)),
            )
        rows.clear()

    for r in cur:
        k = (r[0], r[1])
        if k != key or len(rows) >= BLOCK_ROWS:
            flush()
            key = k
        rows.append(r[2:])
    flush()
    conn.execute("DROP TABLE metrics")
    conn.execute("DELETE FROM meta WHERE key IN ('retention_marks', 'slowdown_metrics_upto')")
    conn.execute("UPDATE merge_origins SET metrics_upto = 0")
