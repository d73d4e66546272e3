"""Years for timestamps that print none, inferred from the data rather than from today.

glog's ``E0101 00:00:05``, mmengine's ``12/31 23:59:58`` and msprobe's ``Dec31_23-59-58``
folder names carry month and day only. Which year they mean follows from two facts the data
gives: the file (or folder) was last written at a known time, so nothing in it is later than
that (an *upper bound*: its mtime), and a log is written in order, so a line is not much earlier
than the line before it (*forward roll-over*: December, then January of the next year).
Today's date is never consulted: a daemon that runs into the new year, or a scan of last year's
logs, gives the same answer as a scan on the day.
"""

from __future__ import annotations

import calendar
import datetime as _dt
import os
import time as _time
from collections.abc import Callable

# A file's mtime can trail the clock of the host that wrote its lines (NFS, another node's clock,
# a zone written as local time): a line up to this much after the bound is still "before" it.
SLACK = 2 * 86400.0
# Lines of one stream come in order, but ranks sharing a file interleave and clocks step back:
# a line this much before the previous one is still the same year.
BACKSTEP = 86400.0
_YEARS_BACK = 8  # enough to find the previous 29 February


def local_epoch(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float | None:
    """Epoch seconds of a naive local time (``TZ`` applies), or None when it is not a date."""
    if not (1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1]):
        return None
    try:
        return _time.mktime((y, mo, d, h, mi, min(s, 59), 0, 0, -1)) + max(0, s - 59)
    except (OverflowError, ValueError):
        return None


def zoned_epoch(
    tz: _dt.tzinfo,
) -> Callable[[int, int, int, int, int, int], float | None]:
    """Like :func:`local_epoch`, for a fixed zone (msprobe's folder names are Asia/Shanghai)."""

    def epoch(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float | None:
        try:
            return _dt.datetime(y, mo, d, h, mi, min(s, 59), tzinfo=tz).timestamp()
        except (OverflowError, ValueError):
            return None

    return epoch


def infer_year(
    mo: int,
    d: int,
    h: int = 0,
    mi: int = 0,
    s: int = 0,
    *,
    bound: float,
    previous: float | None = None,
    epoch: Callable[[int, int, int, int, int, int], float | None] = local_epoch,
) -> int | None:
    """The year of a year-less time, given the data's upper ``bound`` (epoch seconds).

    With ``previous`` (the stream's last dated line), the earliest year that does not put the time
    more than :data:`BACKSTEP` before it (roll-over forward), provided that year is not past the
    bound; else the latest year whose time is not past the bound. None when no year makes it a
    date (31 April).
    """
    top = _dt.datetime.fromtimestamp(bound + SLACK, _dt.timezone.utc).year + 1
    found: list[tuple[int, float]] = []  # (year, epoch), newest first
    for y in range(top, top - _YEARS_BACK - 1, -1):
        t = epoch(y, mo, d, h, mi, s)
        if t is not None:
            found.append((y, t))
    fits = [(y, t) for y, t in found if t <= bound + SLACK]
    if not fits:
        return found[-1][0] if found else None
    if previous is not None:
        later = [(y, t) for y, t in fits if t >= previous - BACKSTEP]
        if later:
            return later[-1][0]
    return fits[0][0]


def file_bound(path: str | None, now: Callable[[], float] = _time.time) -> float:
    """The upper bound of a file's content: its mtime, else the injected clock's now."""
    if path:
        try:
            return os.stat(path).st_mtime
        except (OSError, ValueError):
            pass
    return now()
