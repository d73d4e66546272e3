"""Storing metric blocks: the insert paths of :class:`~nanwatch.store.metrics.Metrics`, in
the caller's transaction (the committer's, with the offsets: invariant 2).

Identity: a block is keyed by (source, first offset), and a block that overlaps offsets
already stored for its source keeps only its new iterations (a final chunk read again by the
next scan, a node database merged twice): one logged iteration is stored once, as it was
when each iteration was a row.

A source's last block grows while it is small (a live pass reads a line or two per file):
the writer keeps it as it last stored it (``_Open``, per writing store) so growing it needs
no read back, and compresses it once it is done growing.
"""

from __future__ import annotations

import sqlite3
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._dc import dataclass
from ..events import Metric
from .metric_blocks import SMALL_BLOCK, Packed, _encoded, _grown, _joined, _Parts, _parts, _summary
from .metric_codec import (
    _MAGIC,
    _NO_ROWS,
    COMPRESS,
    MetricColumns,
    _pack,
    _Sections,
    _sections,
    _unints,
    decode,
)

if TYPE_CHECKING:
    from .db import Store

_ROW_COLS = (
    "run_id, source_id, first_offset, last_offset, n, rank_min, rank_max, step_min, step_max, "
    "time_min, time_max, trained_step_max, trained_epoch_max"
)
_BLOCK_COLS = _ROW_COLS + ", data"


_MARKS = ",".join("?" * (_BLOCK_COLS.count(",") + 1))
_INSERT_BLOCK = f"INSERT INTO metric_blocks({_BLOCK_COLS}) VALUES ({_MARKS})"


@dataclass(slots=True)
class _Open:
    """A source's last block as this writer stored it: its row (without the data), and the
    parts it grows from while it is small. A live pass grows it from here instead of reading
    it back and unpacking it (that cost more than the rest of the pass's writes)."""

    row: tuple[Any, ...]  # id, then _ROW_COLS, as stored
    n: int
    parts: _Parts | None  # None: full (it grows no more)
    raw: bool  # stored uncompressed (to grow): compressed when closed


# per writing store: source id -> its last block (a row that no longer matches is read back)
_OPEN: weakref.WeakKeyDictionary[Store, dict[int, _Open]] = weakref.WeakKeyDictionary()
_OPEN_MAX = 1024  # sources whose open block is kept (the rest are read back when written)


class MetricWriter:
    """The writing half of :class:`~nanwatch.store.metrics.Metrics` (its base class)."""

    store: Store
    _conn: sqlite3.Connection

    # -- writing (in the caller's transaction: the committer's, with the offsets) ------------

    def insert(
        self, run_id: int | None, source_id: int | None, rows: Iterable[Sequence[object]]
    ) -> int:
        """Store Metric tuples (or tuples in its field order); returns how many were new."""
        rows = rows if isinstance(rows, list) else list(rows)
        if not rows:
            return 0
        return self.insert_columns(run_id, source_id, MetricColumns.from_rows(rows))

    def insert_columns(self, run_id: int | None, source_id: int | None, cols: MetricColumns) -> int:
        """Store one chunk's iterations given as parallel columns; returns how many were new."""
        if not len(cols):
            return 0
        lo, hi = min(cols.offset), max(cols.offset)
        new = cols
        grown = None
        if source_id is not None:
            last = self._last(source_id)
            if last is not None and last.row[4] >= lo:  # else no stored block reaches this far
                new = cols = self._unseen(source_id, lo, hi, cols)
                if not len(cols):
                    return 0
            grown = self._after_small_block(last, run_id, cols)
        if grown is None:
            parts = _grown(_parts(_NO_ROWS, 0), 0, cols)
            summary, data = _summary(cols), _pack(len(cols), _encoded(parts), COMPRESS)
        else:
            summary, data, parts = grown
        cur = self.store.execute(
            _INSERT_BLOCK,
            (run_id, source_id, *summary, data),
        )
        if source_id is not None:
            n = int(summary[2])  # type: ignore[call-overload]
            row = (cur.lastrowid, run_id, source_id, *summary)
            self._remember(_Open(row, n, parts if n < SMALL_BLOCK else None, data[:4] == _MAGIC))
        return len(new)

    def insert_packed(self, run_id: int | None, source_id: int | None, p: Packed) -> int:
        """:meth:`insert_columns` of a packed chunk: the same rows stored, its bytes written
        as they are unless the source's last block overlaps it or grows by it (then its
        rows are unpacked and go the columns' way)."""
        lo = p.summary[0]
        if source_id is not None:
            last = self._last(source_id)
            if last is not None:
                if last.row[4] >= lo or (last.row[1] == run_id and last.n + p.n <= SMALL_BLOCK):
                    return self.insert_columns(run_id, source_id, decode(p.data))
                self._close(last)
            _OPEN.get(self.store, {}).pop(source_id, None)  # the next chunk reads it back
        self.store.execute(
            _INSERT_BLOCK,
            (run_id, source_id, *p.summary, p.data),
        )
        return p.n

    def _last(self, source_id: int) -> _Open | None:
        """The source's last block (the one with the highest last offset), if it has one: as
        this writer last wrote it when its row is still the one stored (a transaction rolled
        back, retention or another insert path changed it otherwise), else read back."""
        row = self._conn.execute(
            f"SELECT id, {_ROW_COLS} FROM metric_blocks WHERE source_id = ? "
            "ORDER BY last_offset DESC LIMIT 1",
            (source_id,),
        ).fetchone()
        held = _OPEN.get(self.store, {})
        if row is None:
            held.pop(source_id, None)
            return None
        got = held.get(source_id)
        if got is not None and got.row == row:
            return got
        (blob,) = self._conn.execute(
            "SELECT data FROM metric_blocks WHERE id = ?", (row[0],)
        ).fetchone()
        n, sec = _sections(blob)
        got = _Open(row, n, _parts(sec, n) if n < SMALL_BLOCK else None, blob[:4] == _MAGIC)
        self._remember(got)
        return got

    def _remember(self, block: _Open) -> None:
        held = _OPEN.setdefault(self.store, {})
        held.pop(block.row[2], None)
        held[block.row[2]] = block
        if len(held) > _OPEN_MAX:  # the sources written longest ago go first
            del held[next(iter(held))]

    def _after_small_block(
        self, last: _Open | None, run_id: int | None, cols: MetricColumns
    ) -> tuple[tuple[object, ...], bytes, _Parts] | None:
        """A live pass reads a line or two per file: appended to the source's last block while
        it is small, they cost a few bytes each instead of a block's overhead. The grown block
        is written anew (a new id: readers that follow ids see it; what they had seen of it
        is known to them by offset or step), keyed by the same first offset. Returns its
        summary columns, data and parts, or None (``cols`` make a block of their own)."""
        if last is None:
            return None
        n = last.n + len(cols)
        if last.row[1] != run_id or n > SMALL_BLOCK or last.parts is None:
            self._close(last)
            return None
        if last.row[4] >= min(cols.offset):
            return None  # not after it (a source read again from an earlier offset)
        self.store.execute("DELETE FROM metric_blocks WHERE id = ?", (last.row[0],))
        # its parts grow in place: it is no longer the block stored until the insert is done
        _OPEN[self.store].pop(last.row[2], None)
        # kept raw while it may grow again (each growth would inflate and deflate it whole),
        # compressed once it is full or the next block starts (``_close``)
        parts = _grown(last.parts, last.n, cols)
        data = _pack(n, _encoded(parts), COMPRESS and n >= SMALL_BLOCK)
        return _joined(last.row[3:14], _summary(cols)), data, parts

    def _close(self, last: _Open) -> None:
        """A source's last block is done growing: compressed if it was kept raw to grow."""
        if COMPRESS and last.raw:
            if last.parts is not None:
                sections = _encoded(last.parts)
            else:
                (blob,) = self._conn.execute(
                    "SELECT data FROM metric_blocks WHERE id = ?", (last.row[0],)
                ).fetchone()
                sec = _Sections(blob)
                sections = [sec[i] for i in range(len(Metric._fields))]
            packed = _pack(last.n, sections, True)
            self.store.execute(
                "UPDATE metric_blocks SET data = ? WHERE id = ?", (packed, last.row[0])
            )
            last.raw = False

    def _unseen(self, source_id: int, lo: int, hi: int, cols: MetricColumns) -> MetricColumns:
        """Without the iterations whose offsets a stored block of the source already holds."""
        held: set[int] = set()
        for (blob,) in self._conn.execute(
            "SELECT data FROM metric_blocks WHERE source_id = ? AND last_offset >= ? "
            "AND first_offset <= ?",
            (source_id, lo, hi),
        ):
            n, raw = _sections(blob)
            held.update(x for x in _unints(raw[0], n) if x is not None)
        if not held:
            return cols
        return cols.take([i for i, off in enumerate(cols.offset) if off not in held])
