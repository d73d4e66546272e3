"""Filters the read commands share: --kind, --run, --since/--until, checked before querying so
that a typo is a usage error naming the choices, never an empty answer."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import re
import time
from collections.abc import Callable, Sequence

import click

from ..events import KINDS

# "now" for --since 2h; tests replace it
clock: Callable[[], float] = time.time

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

SINCE_HELP = (
    "Only what happened since then: 30m, 2h, 1d, 1w ago, or an ISO date/time "
    "(2026-11-30, 2026-11-30T10:15; UTC unless it has an offset)."
)
UNTIL_HELP = "Only what happened until then (same forms as --since)."


def check_kind(kind: str | None, option: str = "--kind") -> str | None:
    if kind is not None and kind not in KINDS:
        raise click.UsageError(f"{option} {kind!r}: unknown kind; one of {', '.join(KINDS)}")
    return kind


def parse_when(value: str | None, option: str) -> str | None:
    """``value`` as an RFC 3339 UTC time string comparable with the store's (``...Z``)."""
    if value is None:
        return None
    m = _RELATIVE.match(value)
    if m:
        t = clock() - float(m.group(1)) * _UNIT[m.group(2)]
        when = _dt.datetime.fromtimestamp(t, _dt.timezone.utc)
    else:
        text = value.strip().replace(" ", "T", 1)
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            when = _dt.datetime.fromisoformat(text)
        except ValueError:
            raise click.UsageError(
                f"{option} {value!r}: not a time; use 30m, 2h, 1d, 1w (ago) or an ISO date/time "
                "such as 2026-11-30 or 2026-11-30T10:15"
            ) from None
        # the times nanwatch prints are UTC: a time without an offset is read the same way
        when = when.replace(tzinfo=_dt.timezone.utc) if when.tzinfo is None else when
        when = when.astimezone(_dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def check_limit(limit: int | None) -> int | None:
    if limit is not None and limit < 1:
        raise click.UsageError(f"--limit {limit}: must be 1 or more")
    return limit


def match_runs(pattern: str | None, names: Sequence[str]) -> list[str] | None:
    """The run names ``pattern`` selects: an exact name, a unique suffix on a path component
    boundary (``20261130_101500`` for ``dino/20261130_101500``), or a glob; None for no
    filter. Ambiguous or unmatched patterns are usage errors that list the candidates."""
    if pattern is None:
        return None
    if pattern in names:
        return [pattern]
    if any(c in pattern for c in "*?["):
        found = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    else:
        tail = "/" + pattern.strip("/")
        found = [n for n in names if n.endswith(tail)]
        if len(found) > 1:
            raise click.UsageError(
                f"--run {pattern!r} is ambiguous: it ends {len(found)} runs "
                f"({_listing(found)}); give more of the name, or a glob such as '*{pattern}'"
            )
    if not found:
        known = f"the runs are: {_listing(names)}" if names else "there are no runs yet"
        raise click.UsageError(f"--run {pattern!r} matches no run; {known} (see `nanwatch runs`)")
    return found


def _listing(names: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(names[:most])
    return shown + (f", ... {len(names) - most} more" if len(names) > most else "")


def check_filters(
    kind: str | None, limit: int | None, since: str | None, until: str | None
) -> tuple[str | None, str | None]:
    """The checks `incidents` and `events` share; returns (since, until) as store times."""
    check_kind(kind)
    check_limit(limit)
    return parse_when(since, "--since"), parse_when(until, "--until")
