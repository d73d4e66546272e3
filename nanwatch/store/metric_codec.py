"""The bytes of a metric block (``metric_blocks.data``): one chunk's iterations as packed
columns, and the columns read back from them.

Block format: ``b"NWM1"`` (raw) or ``b"NWMz"`` (every non-empty section zlib-compressed on
its own, so a reader inflates only the columns it needs, and prefixed ``z``; or ``r`` and kept
raw when that is smaller, as for a block of a few rows), then ``uint32 n``, then 13 sections
in :class:`~nanwatch.events.Metric`'s field order, each ``uint32 length`` + bytes, all
little-endian; an empty section means "missing on every row":

- ``offset``, ``rank``, ``step``, ``epoch``, ``iter``: int64; missing is ``-2**63``;
- ``stage``, ``time``: text. ``=`` + the value when every row has it, else ``*`` + the values
  joined by ``\\x1f``, ``\\x00`` standing for a missing one (``J`` + a JSON list when a value
  holds either character);
- ``loss``, ``grad_norm``, ``step_time``, ``data_time``, ``lr``, ``memory``: float64; missing
  is NaN. A NaN read back is missing, as SQLite made of a NaN in a REAL column.
"""

from __future__ import annotations

import json
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from math import isfinite
from typing import Any, cast

from .._dc import dataclass
from ..events import Metric

MISSING = -(2**63)  # an int column's missing value
_NAN = float("nan")
_SWAP = sys.byteorder != "little"
_MAGIC, _MAGIC_Z = b"NWM1", b"NWMz"
_U32 = struct.Struct("<I")
COMPRESS = True  # zlib level 1: a third of the size for a few percent of the write's time
_INTS = ("offset", "rank", "step", "epoch", "iter")
_TEXTS = ("stage", "time")
_FLOATS = ("loss", "grad_norm", "step_time", "data_time", "lr", "memory")


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


# -- unpacking -------------------------------------------------------------------------------


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
    out: list[float] = a.tolist()
    if isfinite(sum(out)):  # no NaN (nor an infinity) among them: nothing is missing
        return cast("list[float | None]", out)
    return [None if v != v else v for v in out]


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


def _raw_ints(raw: bytes, n: int) -> array[int]:
    """An int section as packed, missing values kept as ``MISSING`` (whole columns at once)."""
    a = array("q")
    if raw:
        a.frombytes(raw)
        if _SWAP:
            a.byteswap()
    else:
        a.extend([MISSING] * n)
    return a
