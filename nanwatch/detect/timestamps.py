"""Timestamps in the layouts training stacks print, converted to RFC 3339 UTC.

Naive timestamps are in the node's local time zone (``TZ`` applies), like the logs that carry
them. Year-less layouts (glog ``E0325 20:57:27``, ``[10-12 14:07:33``) take the year that
:func:`nanwatch.sources.dates.infer_year` reads from the data: not after the file's
modification time, and not before the stream's previous dated line (so a log across New Year
rolls over forward).
"""

from __future__ import annotations

import datetime as _dt
import re
import time as _time
from typing import Any

from ..events import format_utc
from ..sources.dates import BACKSTEP, infer_year, local_epoch

# Searched within the first bytes of a line; the first layout that matches wins.
_FULL = re.compile(
    r"(?<!\d)(?P<y>(?:19|20)\d\d)[-/](?P<mo>[01]\d)[-/](?P<d>[0-3]\d)[ T_-]"
    r"(?P<h>[0-2]\d):(?P<mi>[0-5]\d):(?P<s>[0-6]\d)"
    r"(?:[.,](?P<frac>\d{1,9}))?(?:\.\d+)*(?P<tz>Z|[+-][01]\d:?[0-5]\d)?"
)
# glog, and c10's logger inside brackets with an unpadded month: "[E321 02:07:08.408271257 ..."
_FULL_BYTES = re.compile(_FULL.pattern.encode())  # the same, for a line's head as read
_GLOG = re.compile(
    r"^\[?[IWEF](?P<mo>1[0-2]|0?[1-9])(?P<d>[0-3]\d) (?P<h>[0-2]\d):(?P<mi>[0-5]\d):(?P<s>[0-6]\d)"
    r"(?:\.(?P<frac>\d{1,9}))?"
)
# "[10-12 14:07:33 ..." and mmengine's default datefmt "10/26 11:25:41 - mmengine - ..."
_SHORT = re.compile(
    r"^\[?(?P<mo>[01]\d)[-/](?P<d>[0-3]\d) (?P<h>[0-2]\d):(?P<mi>[0-5]\d):(?P<s>[0-6]\d)"
)
_SCAN = 80  # bytes of a line that may hold its timestamp
# Line heads (bytes before a chunk rule's match) remembered with their parsed time. Ranks of
# one run log the same iteration within the same second, so a catch-up scan sees each head
# several times; two generations of this many keep the recent ones (a few MB at most).
HEADS = 16384
_MISS = object()
# "SS.000Z" for whole seconds 0..59: a naive time without a fraction is its minute's prefix
# and one of these
_WHOLE = tuple(f"{s:02d}.000Z" for s in range(60))


class TimeParser:
    """Parses line timestamps; caches the local-time conversion and the UTC text per minute.

    Every iteration line carries a timestamp: this runs hundreds of thousands of times in a
    catch-up scan, so the common layouts avoid ``groupdict`` and ``datetime`` formatting.
    """

    __slots__ = (
        "_bases",
        "_cache",
        "_dates",
        "_heads",
        "_last",
        "_minutes",
        "_old_heads",
        "_prev",
        "_yearless",
        "_yl",
        "bound",
        "default_year",
    )

    def __init__(self, default_year: int | None = None, bound: float | None = None) -> None:
        self._cache: dict[tuple[int, int, int, int, int], float] = {}
        self._minutes: dict[int, str] = {}  # UTC minute (epoch seconds) -> "YYYY-MM-DDTHH:MM:"
        self._dates: dict[bytes, tuple[float | bool, str | None]] = {}
        # the text of a local minute (year, month, day, hour, minute) -> epoch seconds or False
        self._bases: dict[tuple[Any, ...], float | bool] = {}
        self._heads: dict[bytes, str | None] = {}
        self._old_heads: dict[bytes, str | None] = {}
        # the last head read as a whole second: (head, where its seconds are, minute's prefix)
        self._last: tuple[bytes, int, str] | None = None
        # a fixed year (tests, replays); else inferred from ``bound`` (the data's upper bound,
        # set per stream by :meth:`begin`) and the stream's previous dated line
        self.default_year = default_year
        self.bound = bound if bound is not None else _time.time()
        self._prev: float | None = None
        self._yearless = False  # the last parse used an inferred year (not cacheable by head)
        self._yl: dict[bytes, str | None] = {}  # heads with an inferred year, this chunk only

    def begin(self, bound: float, previous: str | None = None) -> None:
        """Start reading a stream's chunk: its content is not later than ``bound`` (its mtime),
        and its last dated line said ``previous`` (RFC 3339 UTC) when it said anything."""
        self.bound = bound
        self._prev = _rfc3339_epoch(previous) if previous else None
        self._yl.clear()

    def _epoch(self, y: int, mo: int, d: int, h: int, mi: int) -> float | None:
        key = (y, mo, d, h, mi)
        base = self._cache.get(key)
        if base is None:
            try:
                base = _time.mktime((y, mo, d, h, mi, 0, 0, 0, -1))
            except (OverflowError, ValueError):
                return None
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = base
        return base

    def parse(self, line: str) -> str | None:
        m = _FULL.search(line, 0, _SCAN)
        if m:
            y, mo, d, h, mi, s, frac, tz = m.groups()
            if tz is None:
                # the common case, inline: a naive local time; its minute is looked up once
                base = self._base(y, mo, d, h, mi)
                sec = int(s)
                if base is False or sec >= 62:
                    return None
                return self._utc(base + sec + (float("0." + frac) if frac else 0.0))
            return self.parse_fields(int(y), int(mo), int(d), int(h), int(mi), int(s), frac, tz)
        head = line[:_SCAN]
        m = _GLOG.match(head) or _SHORT.match(head)
        if not m:
            return None
        return self._from_match(m, None)

    def parse_bytes(self, head: bytes) -> str | None:
        """:meth:`parse` of a line's head as read (no decoding for the common ASCII case)."""
        got: Any = self._heads.get(head, _MISS)
        if got is _MISS:
            got = self._old_heads.get(head, _MISS)
            if got is _MISS:
                got = self._yl.get(head, _MISS)
                if got is not _MISS:
                    yl: str | None = got
                    return yl
                self._yearless = False
                got = self._next_second(head) or self._parse_bytes(head)
                if self._yearless:
                    # its year depends on the stream, not only on the bytes: remembered for
                    # this chunk of this stream only
                    if len(self._yl) < HEADS:
                        self._yl[head] = got
                    yl = got
                    return yl
            if len(self._heads) >= HEADS:
                self._old_heads, self._heads = self._heads, {}
            self._heads[head] = got
        when: str | None = got
        return when

    def minute(self, date: bytes) -> tuple[float | bool, str | None]:
        """A naive local ``YYYY/MM/DD HH:MM`` (or ``-``) as read: (epoch seconds of the minute,
        False when it is no valid time; "YYYY-MM-DDTHH:MM:" of that minute in UTC when it starts
        on a UTC minute, else None). What :meth:`parse_bytes` computes for a line whose head
        starts with that minute and a whole second, for the column reader."""
        got = self._dates.get(date)
        if got is None:
            if len(self._dates) > 4096:
                self._dates.clear()
            base = self._base(date[0:4], date[5:7], date[8:10], date[11:13], date[14:16])
            prefix = None
            if base is not False and int(base) == base and int(base) % 60 == 0:
                prefix = self._utc(float(base))[:-7]
            got = self._dates[date] = (base, prefix)
        return got

    def utc(self, ts: float) -> str:
        """RFC 3339 UTC text of epoch seconds (cached per minute)."""
        return self._utc(ts)

    def _next_second(self, head: bytes) -> str | None:
        """The last whole-second head with other seconds (the next line of a log, usually).

        Its layout matched at the same place: every byte but the two digits of the seconds is
        the same, and the bytes before them are a whole date and time up to the minute, which
        no earlier position can read past (the first ``:`` before the seconds is the minute's).
        """
        last = self._last
        if last is None:
            return None
        text, at, prefix = last
        if len(head) != len(text) or head[:at] != text[:at] or head[at + 2 :] != text[at + 2 :]:
            return None
        tens, ones = head[at], head[at + 1]
        if not (48 <= tens <= 53 and 48 <= ones <= 57):  # 00..59
            return None
        return prefix + _WHOLE[(tens - 48) * 10 + ones - 48]

    def _parse_bytes(self, head: bytes) -> str | None:
        if not head:
            return None
        if not head.isascii():
            return self.parse(head.decode("utf-8", "replace"))
        m = _FULL_BYTES.search(head, 0, _SCAN)
        if m is None:
            return self.parse(head.decode("ascii"))
        y, mo, d, h, mi, s, frac, tz = m.groups()
        if tz is not None:
            return self.parse(head.decode("ascii"))
        base = self._base(y, mo, d, h, mi)
        sec = int(s)
        if base is False or sec >= 62:
            return None
        if frac is None and sec < 60:
            # a whole second of a minute that starts on a UTC minute: no arithmetic needed
            minute = int(base)
            if minute == base and minute % 60 == 0:
                prefix = self._minutes.get(minute)
                if prefix is not None:
                    self._last = (head, m.start("s"), prefix)
                    return prefix + _WHOLE[sec]
        return self._utc(base + sec + (float(b"0." + frac) if frac else 0.0))

    def _base(
        self, y: str | bytes, mo: str | bytes, d: str | bytes, h: str | bytes, mi: str | bytes
    ) -> float | bool:
        """Epoch seconds of a local minute given as text (False: not a valid time), cached."""
        key = (y, mo, d, h, mi)
        base = self._bases.get(key)
        if base is None:
            if len(self._bases) > 4096:
                self._bases.clear()
            base = self._bases[key] = self._minute(int(y), int(mo), int(d), int(h), int(mi))
        return base

    def _minute(self, y: int, mo: int, d: int, h: int, mi: int) -> float | bool:
        """Epoch seconds of a local minute; False when it is not a valid one."""
        if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60):
            return False
        base = self._epoch(y, mo, d, h, mi)
        return False if base is None else base

    def _utc(self, ts: float) -> str:
        """:func:`format_utc`, with the date and time up to the minute formatted once."""
        ms = round(ts * 1000)
        sec, milli = divmod(ms, 1000)
        minute = sec - sec % 60
        prefix = self._minutes.get(minute)
        if prefix is None:
            if len(self._minutes) > 4096:
                self._minutes.clear()
            prefix = _dt.datetime.fromtimestamp(minute, _dt.timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:"
            )
            self._minutes[minute] = prefix
        return f"{prefix}{sec - minute:02d}.{milli:03d}Z"

    def parse_fields(
        self,
        y: int | None,
        mo: int,
        d: int,
        h: int,
        mi: int,
        s: int,
        frac: str | None,
        tz: str | None = None,
    ) -> str | None:
        if not (1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 62):
            return None
        if y is not None:
            year = y
        elif self.default_year is not None:
            year = self.default_year
        else:
            self._yearless = True
            inferred = infer_year(mo, d, h, mi, s, bound=self.bound, previous=self._prev)
            if inferred is None:
                return None
            year = inferred
            t = local_epoch(year, mo, d, h, mi, s)
            if t is not None and (self._prev is None or t > self._prev - BACKSTEP):
                self._prev = t if self._prev is None else max(self._prev, t)
        fr = float("0." + frac) if frac else 0.0
        if tz:
            sign = 1 if tz[0] == "+" else -1
            off = 0 if tz == "Z" else sign * (int(tz[1:3]) * 3600 + int(tz[-2:]) * 60)
            try:
                dt = _dt.datetime(year, mo, d, h, mi, min(s, 59), tzinfo=_dt.timezone.utc)
            except ValueError:
                return None
            return format_utc(dt.timestamp() - off + fr)
        base = self._epoch(year, mo, d, h, mi)
        if base is None:
            return None
        return self._utc(base + s + fr)

    def _from_match(self, m: re.Match[str], year: int | None) -> str | None:
        """A year-less layout's match (``year`` None: inferred)."""
        g = m.groupdict()
        return self.parse_fields(
            year,
            int(g["mo"]),
            int(g["d"]),
            int(g["h"]),
            int(g["mi"]),
            int(g["s"]),
            g.get("frac"),
            g.get("tz"),
        )


def _rfc3339_epoch(text: str) -> float | None:
    try:
        return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
