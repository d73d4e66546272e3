"""How much work one line may cost: a length cap per rule, a time budget per match, and a lint
that refuses the pattern shapes whose cost grows faster than the line.

A log line can be megabytes long (a tensor dump, a progress bar that never printed a newline),
and a pattern that backtracks quadratically turns one such line into minutes on the writer
thread: no watchdog ping, no SIGTERM, the same line again after the restart. So:

- each rule examines at most ``max_chars`` characters of a line (``LINE_LIMIT`` by default);
  the rest is skipped and counted;
- a match on a long line runs with a time budget (``MATCH_BUDGET``); a rule that runs out of
  it gives nothing for that line, and that is counted and logged once;
- at load, a pattern with an unbounded lookbehind (it rescans the line before every candidate
  position) or with nested unbounded quantifiers (``(a+)*``: exponential backtracking) is
  refused, naming the file, the rule and the fix. Shipped packs and site packs alike.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from ..stream import STEP_LIMIT

# the stdlib's own regex parser reads a pattern's structure (private: typeshed does not
# describe it; ``sre_parse`` before Python 3.11)
try:
    _sre: Any = importlib.import_module("re._parser")
    _c: Any = importlib.import_module("re._constants")
except ImportError:  # pragma: no cover - Python 3.10
    _sre = importlib.import_module("sre_parse")
    _c = importlib.import_module("sre_constants")
_NONE = object()  # an opcode that Python 3.10 lacks never matches
_POSSESSIVE = getattr(_c, "POSSESSIVE_REPEAT", _NONE)
_ATOMIC = getattr(_c, "ATOMIC_GROUP", _NONE)

LINE_LIMIT = 64 * 1024  # characters of a line a rule examines unless it says otherwise
MAX_CHARS_MAX = 4 * 1024 * 1024  # the longest line the sources hand over
LONG_LINE = 2048  # shorter lines cannot be slow enough to need a time budget
PREFIX_LIMIT = 4096  # characters of a line a prefix pattern (rank, host...) may span
MATCH_BUDGET = 0.5  # seconds one rule may spend on one long line (shipped ones: ~0.1 at most)
COUNT_LIMIT = STEP_LIMIT  # a rank, epoch, iteration or step the text prints is below this


def count(value: Any) -> int | None:
    """A rank, epoch, iteration or step read from the text, or None when it is not a number or
    is beyond what a run can count ("[rank99999999999999999999]" is no rank: the database's
    64-bit columns could not even hold it)."""
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        # "10,100": a counter printed with thousands grouped
        if not (isinstance(value, str) and _GROUPED.match(value)):
            return None
        n = int(value.replace(",", ""))
    return n if -COUNT_LIMIT < n < COUNT_LIMIT else None


_GROUPED = re.compile(r"\d{1,3}(?:,\d{3})+\Z")


LOOKBEHIND_MAX = 255  # characters a lookbehind may look back

_GROUP = re.compile(r"\(\?P<(\w+)>")
# syntax of the `regex` module that the stdlib parser does not know, replaced by something of
# the same width so the structure can still be read
_REGEX_ONLY = (
    (re.compile(r"\\[GK]"), "(?:)"),
    (re.compile(r"\\[pP]\{[^}]*\}|\\[pP][A-Za-z]|\\X"), "."),
)
_REPEATS = (_c.MAX_REPEAT, _c.MIN_REPEAT)
_UNBOUNDED = _c.MAXREPEAT


def _readable(pattern: str) -> str:
    """The pattern in the stdlib's dialect: later groups of a repeated name renamed."""
    seen: set[str] = set()
    n = 0

    def rename(m: re.Match[str]) -> str:
        nonlocal n
        if m.group(1) not in seen:
            seen.add(m.group(1))
            return m.group(0)
        n += 1
        return f"(?P<_dup{n}>"

    out = _GROUP.sub(rename, pattern)
    for rx, repl in _REGEX_ONLY:
        out = rx.sub(repl, out)
    return out


def lint(pattern: str) -> str | None:
    """Why ``pattern`` may cost more than linear time on a long line (with the fix), or None.

    A pattern the stdlib parser cannot read (``regex``-only syntax beyond the common cases)
    is not judged here; the length cap and the time budget still bound it.
    """
    try:
        tree = _sre.parse(_readable(pattern))
    except (re.error, RecursionError, OverflowError):
        return None
    return _walk(tree, False, False)


def _walk(items: Any, in_repeat: bool, atomic: bool) -> str | None:
    for op, av in items:
        found: str | None = None
        if op in _REPEATS:
            _lo, hi, item = av
            unbounded = hi == _UNBOUNDED and not atomic
            if unbounded and in_repeat:
                return (
                    f"has nested unbounded quantifiers ({_show(item)} repeated inside a repeated "
                    "group): backtracking can take exponential time; make the inner or outer "
                    "repeat possessive (*+, ++), atomic (?>...), or bound it ({0,N})"
                )
            found = _walk(item, in_repeat or unbounded, atomic)
        elif op == _POSSESSIVE:
            found = _walk(av[2], in_repeat, True)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            direction, item = av
            if direction < 0 and item.getwidth()[1] > LOOKBEHIND_MAX:
                return (
                    "has a lookbehind of unbounded length: it rescans the line before every "
                    f"candidate position (quadratic); bound it to {LOOKBEHIND_MAX} characters "
                    "({0,N} instead of * or +), or match the context forward"
                )
            found = _walk(item, in_repeat, atomic)
        elif op == _c.SUBPATTERN:
            found = _walk(av[3], in_repeat, atomic)
        elif op == _ATOMIC:
            found = _walk(av, in_repeat, True)
        elif op == _c.BRANCH:
            for branch in av[1]:
                found = found or _walk(branch, in_repeat, atomic)
        elif op == _c.GROUPREF_EXISTS:
            found = _walk(av[1], in_repeat, atomic) or (
                _walk(av[2], in_repeat, atomic) if av[2] is not None else None
            )
        if found:
            return found
    return None


def adversarial_lines(
    literals: Sequence[str], examples: Iterable[str], size: int, *, per_literal: int = 8
) -> list[str]:
    """Lines where a backtracking pattern is slowest: a rule's own literals and example lines
    repeated to ``size`` characters, without the line structure the rule needs, and literals
    followed by long runs of spaces, word characters or numbers (the bench and the tests)."""
    fragments = [*examples, " ".join(literals), *literals]
    out = []
    for frag in dict.fromkeys(f for f in fragments if f):
        out.append((frag + " ") * (size // (len(frag) + 1) + 1))
        out.append(frag * (size // len(frag) + 1))
    for lit in list(dict.fromkeys(literals))[:per_literal]:
        out += [lit + " " * size, lit + "x" * size, lit + ":" + " 1.0" * (size // 4)]
    return out


def _show(item: Any) -> str:
    """A short name for a repeated part of a parsed pattern."""
    ops = {op for op, _ in item}
    if ops == {_c.IN}:
        return "a character class"
    if ops == {_c.LITERAL}:
        return "a literal"
    return "a group"
