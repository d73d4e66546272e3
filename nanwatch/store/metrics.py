"""Per-iteration metrics as columnar blocks: one ``metric_blocks`` row per (source, chunk).

A catch-up scan logs hundreds of thousands of iterations; a row (and two index entries) per
iteration made storing them the costliest part of a scan and reading one run's step times
back a walk over millions of rows. A block holds one chunk's iterations as packed columns,
written in the same transaction as the chunk's offset (invariant 2), with the few summaries
readers filter on (offsets, steps, ranks, times) as plain columns beside it.

Identity: a block is keyed by (source, first offset), and a block that overlaps offsets
already stored for its source keeps only its new iterations (a final chunk read again by the
next scan, a node database merged twice): one logged iteration is stored once, as it was
when each iteration was a row.

Block format (``metric_blocks.data``): ``b"NWM1"`` (raw) or ``b"NWMz"`` (every non-empty
section zlib-compressed on its own, so a reader inflates only the columns it needs, and
prefixed ``z``; or ``r`` and kept raw when that is smaller, as for a block of a few rows), then
``uint32 n``, then 13 sections in :class:`~nanwatch.events.Metric`'s field order, each
``uint32 length`` + bytes, all little-endian; an empty section means "missing on every row":

- ``offset``, ``rank``, ``step``, ``epoch``, ``iter``: int64; missing is ``-2**63``;
- ``stage``, ``time``: text. ``=`` + the value when every row has it, else ``*`` + the values
  joined by ``\\x1f``, ``\\x00`` standing for a missing one (``J`` + a JSON list when a value
  holds either character);
- ``loss``, ``grad_norm``, ``step_time``, ``data_time``, ``lr``, ``memory``: float64; missing
  is NaN. A NaN read back is missing, as SQLite made of a NaN in a REAL column.
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
import struct
import sys
import weakref
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..events import Metric
from .records import JSON, MetricRow

if TYPE_CHECKING:
    from .db import Store

MISSING = -(2**63)  # an int column's missing value
_NAN = float("nan")
_INF = float("inf")
_SWAP = sys.byteorder != "little"
_MAGIC, _MAGIC_Z = b"NWM1", b"NWMz"
_U32 = struct.Struct("<I")
COMPRESS = True  # zlib level 1: a third of the size for a few percent of the write's time
_INTS = ("offset", "rank", "step", "epoch", "iter")
_TEXTS = ("stage", "time")
_FLOATS = ("loss", "grad_norm", "step_time", "data_time", "lr", "memory")
BLOCK_ROWS = 4096  # rows per block when rows are converted (migration 5)
SMALL_BLOCK = 256  # a source's last block grows by appending while it holds fewer rows

_ROW_COLS = (
    "run_id, source_id, first_offset, last_offset, n, rank_min, rank_max, step_min, step_max, "
    "time_min, time_max, trained_step_max, trained_epoch_max"
)
_BLOCK_COLS = _ROW_COLS + ", data"


_MARKS = ",".join("?" * (_BLOCK_COLS.count(",") + 1))
_INSERT_BLOCK = f"INSERT INTO metric_blocks({_BLOCK_COLS}) VALUES ({_MARKS})"


@dataclass(frozen=True, slots=True)
class MetricColumns:
    """Parallel columns, one entry per logged iteration, in :class:`Metric`'s field order."""

    offset: Sequence[int]
    rank: Sequence[int | None]
    step: Sequence[int | None]
    epoch: Sequence[int | None]
    iter: Sequence[int | None]
    stage: Sequence[str | None]
    time: Sequence[str | None]
    loss: Sequence[float | None]
    grad_norm: Sequence[float | None]
    step_time: Sequence[float | None]
    data_time: Sequence[float | None]
    lr: Sequence[float | None]
    memory: Sequence[float | None]

    def __len__(self) -> int:
        return len(self.offset)

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[object]]) -> MetricColumns:
        """Columns of Metric tuples (or plain tuples in its field order)."""
        cols = list(zip(*rows))
        if not cols:
            return EMPTY
        while len(cols) < len(Metric._fields):
            cols.append((None,) * len(cols[0]))
        return cls(*cols)

    def rows(self) -> Iterator[Metric]:
        return map(Metric._make, zip(*(getattr(self, f) for f in Metric._fields)))

    def take(self, keep: Sequence[int]) -> MetricColumns:
        """The rows at positions ``keep``."""
        return MetricColumns(*([getattr(self, f)[i] for i in keep] for f in Metric._fields))


EMPTY = MetricColumns(*([] for _ in Metric._fields))


@dataclass(frozen=True, slots=True)
class Packed:
    """One chunk's iterations as a block ready to store: its summary columns and data (what
    :func:`pack` makes where the chunk was read, a detection worker, so the writer stores
    bytes instead of packing hundreds of thousands of values itself)."""

    n: int
    summary: tuple[Any, ...]  # the block's summary columns, first_offset to trained_epoch_max
    data: bytes

    def __len__(self) -> int:
        return self.n

    @property
    def times(self) -> tuple[str | None, str | None]:
        """The earliest and latest time of its rows."""
        return self.summary[7], self.summary[8]


def pack(columns: Sequence[Sequence[Any]]) -> Packed | None:
    """Columns in Metric's field order as a block to store; None when there are no rows."""
    cols = MetricColumns(*columns)
    if not len(cols):
        return None
    return Packed(len(cols), _summary(cols), encode(cols))


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


# -- packing ---------------------------------------------------------------------------------


# The usual column has no missing value: array() takes it whole, and raises TypeError on a
# None (cheaper than looking for one first); only then are missing values replaced.


def _ints(col: Sequence[int | None]) -> bytes:
    try:
        a = array("q", cast("Sequence[int]", col))
    except (TypeError, OverflowError):
        if col.count(None) == len(col):
            return b""
        # bad input is data: a value that is no int64 is stored as missing
        a = array("q", [v if type(v) is int and -(2**63) < v < 2**63 else MISSING for v in col])
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _floats(col: Sequence[float | None]) -> bytes:
    try:
        a = array("d", cast("Sequence[float]", col))
    except TypeError:
        if col.count(None) == len(col):
            return b""
        try:  # the usual reason: a few missing values
            a = array("d", [_NAN if v is None else v for v in col])
        except TypeError:
            a = array("d", [float(v) if isinstance(v, (int, float)) else _NAN for v in col])
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _texts(col: Sequence[str | None]) -> bytes:
    n = len(col)
    if not n:
        return b""
    first = col[0]
    if col.count(first) == n:
        return b"" if first is None else b"=" + first.encode()
    values = [v if v is not None else "\x00" for v in col] if None in col else col
    joined = "\x1f".join(values)  # type: ignore[arg-type]
    if joined.count("\x1f") != n - 1 or joined.count("\x00") != col.count(None):
        return b"J" + json.dumps(list(col)).encode()
    return b"*" + joined.encode()


def encode(cols: MetricColumns, *, compress: bool = COMPRESS) -> bytes:
    sections = [
        _ints(col) if name in _INTS else _texts(col) if name in _TEXTS else _floats(col)
        for name, col in zip(Metric._fields, (getattr(cols, f) for f in Metric._fields))
    ]
    return _pack(len(cols), sections, compress)


def _pack(n: int, sections: Iterable[bytes | bytearray], compress: bool) -> bytes:
    parts: list[bytes | bytearray] = [_MAGIC_Z if compress else _MAGIC, _U32.pack(n)]
    for raw in sections:
        if compress and raw:
            # a few rows (a live pass) compress to more than they are: kept raw then
            z = zlib.compress(raw, 1)
            raw = b"z" + z if len(z) < len(raw) else b"r" + raw
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


_FILL_Q, _FILL_D = struct.pack("<q", MISSING), struct.pack("<d", _NAN)  # one missing value


def grow(blob: bytes, cols: MetricColumns, *, compress: bool = COMPRESS) -> bytes:
    """The block ``blob`` with ``cols`` appended: the bytes ``encode`` gives for the rows of
    both, without turning the stored rows back into values (their number and text columns
    are joined as packed, only the two text columns are read). A live pass appends a few
    rows to a block of up to ``SMALL_BLOCK``: decoding and packing it whole each time cost
    more than everything else the pass wrote."""
    n, old = _sections(blob)
    return _pack(n + len(cols), _encoded(_grown(_parts(old, n), n, cols)), compress)


# A block's sections as a growing block keeps them: number columns packed, text columns as
# their values (a text section is re-joined whole when rows are added). ``_grown`` appends to
# them in place: a live pass adds a few rows to a block of up to SMALL_BLOCK.
_Parts = list[bytearray | list[str | None]]


def _parts(sec: _Sections, n: int) -> _Parts:
    return [
        _untexts(sec[i], n) if name in _TEXTS else bytearray(sec[i])
        for i, name in enumerate(Metric._fields)
    ]


def _grown(parts: _Parts, n: int, cols: MetricColumns) -> _Parts:
    """``parts`` (of ``n`` rows) with ``cols`` appended, in place; returns ``parts``."""
    k = len(cols)
    for i, name in enumerate(Metric._fields):
        col = getattr(cols, name)
        before = parts[i]
        if isinstance(before, list):
            before.extend(col)
            continue
        new, fill = (_ints(col), _FILL_Q) if name in _INTS else (_floats(col), _FILL_D)
        # an empty section is "missing on every row": spelt out when the other part has values
        if not before and not new:
            continue
        if not before:
            before += fill * n
        before += new or fill * k
    return parts


def _encoded(parts: _Parts) -> list[bytes | bytearray]:
    return [_texts(p) if isinstance(p, list) else p for p in parts]


def _unints(raw: bytes, n: int) -> list[int | None]:
    if not raw:
        return [None] * n
    a = array("q")
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()
    out: list[int | None] = list(a.tolist())
    return [None if v == MISSING else v for v in out] if MISSING in a else out


def _unfloats(raw: bytes, n: int) -> list[float | None]:
    if not raw:
        return [None] * n
    a = array("d")
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()
    return [None if v != v else v for v in a.tolist()]


def _untexts(raw: bytes, n: int) -> list[str | None]:
    if not raw:
        return [None] * n
    tag, rest = raw[:1], raw[1:].decode()
    if tag == b"=":
        return [rest] * n
    if tag == b"J":
        got: list[str | None] = json.loads(rest)
        return got
    return [None if v == "\x00" else v for v in rest.split("\x1f")]


class _Sections:
    """A block's sections, each decompressed only when asked for (a reader of step times
    never inflates the loss or time columns)."""

    __slots__ = ("_blob", "_pos", "_z", "n")

    def __init__(self, blob: bytes) -> None:
        head = blob[:4]
        if head not in (_MAGIC, _MAGIC_Z):
            raise ValueError(f"not a metric block (starts with {head!r})")
        self._blob, self._z = blob, head == _MAGIC_Z
        (self.n,) = _U32.unpack_from(blob, 4)
        pos, self._pos = 8, []
        for _ in Metric._fields:
            (size,) = _U32.unpack_from(blob, pos)
            self._pos.append((pos + 4, pos + 4 + size))
            pos += 4 + size

    def __getitem__(self, i: int) -> bytes:
        lo, hi = self._pos[i]
        raw = self._blob[lo:hi]
        if not self._z or not raw:
            return raw
        return zlib.decompress(raw[1:]) if raw[:1] == b"z" else raw[1:]


_NO_ROWS = _Sections(_pack(0, [b""] * len(Metric._fields), False))


def _sections(blob: bytes) -> tuple[int, _Sections]:
    sec = _Sections(blob)
    return sec.n, sec


def _column(raw: _Sections, i: int, n: int) -> Sequence[Any]:
    name = Metric._fields[i]
    if name in _INTS:
        return _unints(raw[i], n)
    if name in _TEXTS:
        return _untexts(raw[i], n)
    return _unfloats(raw[i], n)


def decode(blob: bytes) -> MetricColumns:
    n, raw = _sections(blob)
    return MetricColumns(*(_column(raw, i, n) for i in range(len(Metric._fields))))


class _Unpacked(MetricColumns):
    """A stored block's columns, each unpacked when first read: the slowdown tracker reads
    four of the thirteen of every block (and the others of a few rows)."""

    __slots__ = ("_n", "_raw")

    def __init__(self, blob: bytes) -> None:  # the dataclass's fields are filled when read
        n, raw = _sections(blob)
        object.__setattr__(self, "_n", n)
        object.__setattr__(self, "_raw", raw)

    def __getattr__(self, name: str) -> Any:  # only for a field not read yet
        i = _FIELD.get(name)
        if i is None:
            raise AttributeError(name)
        value = _column(self._raw, i, self._n)
        object.__setattr__(self, name, value)
        return value

    def __len__(self) -> int:
        return int(self._n)


_FIELD = {name: i for i, name in enumerate(Metric._fields)}


def unpacked(blob: bytes) -> MetricColumns:
    """:func:`decode`, column by column as they are read."""
    return _Unpacked(blob)


def _span(col: Sequence[Any]) -> tuple[Any, Any]:
    """(lowest, highest) of the known values; (None, None) when none is."""
    try:
        return min(col), max(col)
    except (TypeError, ValueError):  # a missing value among them, or none at all
        if col.count(None) == len(col):
            return None, None
        known = [v for v in col if v is not None]
        return min(known), max(known)


def _highest(col: Sequence[Any], cuts: list[int]) -> Any:
    """The highest known value of ``col`` outside the rows at ``cuts`` (sorted, between a
    first -1 and a last ``len(col)``)."""
    best = None
    for a, b in itertools.pairwise(cuts):
        if b - a > 1:
            part = col[a + 1 : b]
            try:
                hi = max(part)
            except TypeError:  # a missing value among them
                hi = _span(part)[1]
            if hi is not None and (best is None or hi > best):
                best = hi
    return best


def _trained(cols: MetricColumns, step_hi: int | None) -> tuple[Any, Any]:
    """The highest step and epoch of the training rows with a finite loss."""
    n = len(cols)
    loss = cols.loss
    if cols.stage.count("train") == n:
        # a training chunk whose losses are finite where known (a finite sum says so; filter
        # drops the missing ones, and the zeros, which change no sum)
        missing = loss.count(None)
        if missing <= 64 and _finite(sum(cast("Iterable[float]", filter(None, loss)))):
            if not missing:  # the usual chunk
                return step_hi, _span(cols.epoch)[1]
            # a few rows without a loss: every other row is a trained one
            at, cuts = -1, [-1]
            for _ in range(missing):
                at = cast("list[float | None]", loss).index(None, at + 1)
                cuts.append(at)
            cuts.append(n)
            return _highest(cols.step, cuts), _highest(cols.epoch, cuts)
    trained = [
        (s, e)
        for st, s, e, v in zip(cols.stage, cols.step, cols.epoch, loss)
        if st == "train" and v is not None and -_INF < v < _INF
    ]
    return _span([s for s, _ in trained])[1], _span([e for _, e in trained])[1]


def _summary(cols: MetricColumns) -> tuple[object, ...]:
    """The plain columns beside the packed data: what readers filter blocks on."""
    n = len(cols)
    step_lo, step_hi = _span(cols.step)
    t_step, t_epoch = _trained(cols, step_hi)
    return (
        min(cols.offset),
        max(cols.offset),
        n,
        *_span(cols.rank),
        step_lo,
        step_hi,
        *_span(cols.time),
        t_step,
        t_epoch,
    )


def _lo(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else min(a, b)


def _hi(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None else max(a, b)


def _joined(before: Sequence[Any], after: Sequence[Any]) -> tuple[object, ...]:
    """``_summary`` of two blocks' rows together, from the summaries of each (spans join)."""
    lo0, hi0, n, rmin, rmax, smin, smax, tmin, tmax, tstep, tepoch = before
    lo1, hi1, n1, rmin1, rmax1, smin1, smax1, tmin1, tmax1, tstep1, tepoch1 = after
    return (
        _lo(lo0, lo1),
        _hi(hi0, hi1),
        n + n1,
        _lo(rmin, rmin1),
        _hi(rmax, rmax1),
        _lo(smin, smin1),
        _hi(smax, smax1),
        _lo(tmin, tmin1),
        _hi(tmax, tmax1),
        _hi(tstep, tstep1),
        _hi(tepoch, tepoch1),
    )


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


# -- the repository --------------------------------------------------------------------------


class Metrics:
    """The ``metric_blocks`` table family of one :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._conn = store._conn

    @classmethod
    def reading(cls, conn: sqlite3.Connection) -> Metrics:
        """A reader over a connection a sink was handed (the outbox gives sinks connections)."""
        from .db import Store

        return cls(Store(Store.last_opened or Path(), conn, readonly=True))

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
            n += sum(
                1
                for st, s, loss in zip(c.stage, c.step, c.loss)
                if st == "train" and s is not None and s > step and _finite(loss)
            )
        return n

    def trained_before(self, run_id: int, step: int) -> int | None:
        """The last step before ``step`` the run trained with a finite loss."""
        best: int | None = None
        for b in self._trained(run_id, "step_min < ?", step):
            c = b.columns
            for st, s, loss in zip(c.stage, c.step, c.loss):
                if st == "train" and s is not None and s < step and _finite(loss):
                    best = s if best is None or s > best else best
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


def _raw_ints(raw: bytes, n: int) -> array[int]:
    a = array("q")
    if raw:
        a.frombytes(raw)
        if _SWAP:
            a.byteswap()
    else:
        a.extend([MISSING] * n)
    return a


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


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
