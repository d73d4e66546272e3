"""What a metric block knows of its rows besides their bytes, and how a small block grows.

- The summary: the plain columns stored beside the packed data (offsets, row count, rank,
  step and time spans, the highest trained step and epoch), what readers filter blocks on;
  :func:`pack` makes a block's summary and bytes where the chunk was read.
- Growth: a source's last block, while it holds fewer than ``SMALL_BLOCK`` rows, takes the
  next few rows of a live pass by appending to its packed sections instead of being decoded
  and packed whole; the result is the bytes :func:`~nanwatch.store.metric_codec.encode` gives
  for all its rows, and its summary is joined from the two summaries.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import eq
from typing import Any, cast

from .._dc import dataclass
from ..events import Metric
from .metric_codec import (
    _INTS,
    _NAN,
    _TEXTS,
    COMPRESS,
    MISSING,
    MetricColumns,
    _floats,
    _ints,
    _pack,
    _Sections,
    _sections,
    _texts,
    _untexts,
    encode,
)

_INF = float("inf")
SMALL_BLOCK = 256  # a source's last block grows by appending while it holds fewer rows


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


# -- summary ---------------------------------------------------------------------------------


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


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


def trained_rows(cols: MetricColumns) -> list[bool]:
    """Which rows are training rows with a finite loss: picked whole columns at a time, and
    row by row only when a training loss is missing or not finite."""
    train = list(map(eq, repeat("train"), cols.stage))
    losses = list(itertools.compress(cols.loss, train))
    if None in losses or not math.isfinite(sum(cast("list[float]", losses))):
        train = [t and v is not None and -_INF < v < _INF for t, v in zip(train, cols.loss)]
    return train


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
    train = trained_rows(cols)
    return (
        _span(list(itertools.compress(cols.step, train)))[1],
        _span(list(itertools.compress(cols.epoch, train)))[1],
    )


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


# -- growth ----------------------------------------------------------------------------------


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
