"""Which chunk core reads iteration lines as columns: compiled (``_chunkcore.c``) or pure Python.

The compiled core reads one format, the ``mmengine.iter_line`` rule as parsers/mmengine.toml
ships it, without a regex match object per line; it is used for a columns format only when
the rule's pattern and head are, to the character, the ones it was written for, and no line
prefix (a rank tag) can start where that format's head does. Otherwise, when it is not built,
or with ``NANWATCH_PURE=1``, the pure-Python reader (``columns.py``) reads every chunk: it is the
reference the compiled core is tested against, and the core hands it any chunk it does not
read exactly as it would (it returns None).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from importlib import import_module
from pathlib import Path
from types import ModuleType
from typing import Any

PURE_ENV = "NANWATCH_PURE"
CORE_VERSION = 3  # _chunkcore.c's VERSION: the interface this module calls

# what _chunkcore.c reads (the rule's pattern and its columns head, as parsers/mmengine.toml
# has them); a rule that differs in one character is read by the Python path
MMENGINE_PATTERN = (
    r"(?:Epoch|Iter)\((?P<stage>train|val|test)\) *(?:\[(?P<epoch>\d+)\])? *\[ *(?P<iter>\d+)"
    r"/(?P<iters>\d+)\](?: +base_lr: \S+)?(?: +lr: (?P<lr>\S+))?(?: +eta: (?:\d+ days?, )?"
    r"\d+:\d\d:\d\d)?(?: +time: (?P<time>[\d.]+))?(?: +data_time: (?P<data_time>[\d.]+))?"
    r"(?: +memory: (?P<memory>\d+))?(?: +grad_norm: (?P<grad_norm>\S+))?(?: +loss: (?P<loss>\S+))?"
)
MMENGINE_HEAD = (
    r"(?:(?P<_date>(?:19|20)\d\d/[01]\d/[0-3]\d [0-2]\d:[0-5]\d):(?P<_sec>[0-6]\d)"
    r"|[01]\d/[0-3]\d [0-2]\d:[0-5]\d:[0-6]\d) - mmengine - [A-Z]+ - "
)
# the core's columns, in the order it returns them after (starts, ends, line index): the group
# each one stands for
GROUPS = (
    "_head",
    "_date",
    "_sec",
    "stage",
    "epoch",
    "iter",
    "iters",
    "lr",
    "time",
    "data_time",
    "memory",
    "grad_norm",
    "loss",
)
# heads of every shape the core reads (each digit class at its ends): a prefix that could
# start a match in one of them would make the rows regex skip a line the core takes
_HEADS = (
    b"2024/08/26 16:38:23 - mmengine - INFO - ",
    b"1900/00/00 00:00:00 - mmengine - A - ",
    b"2099/19/39 29:59:69 - mmengine - WARNING - ",
    b"10/26 11:42:04 - mmengine - INFO - ",
    b"00/00 00:00:00 - mmengine - Z - ",
    b"19/39 29:59:69 - mmengine - ERROR - ",
)

RowsFn = Callable[[bytes, int], "tuple[list[Any], ...] | None"]


def _load() -> tuple[ModuleType | None, str]:
    try:
        mod = import_module(".detect._chunkcore", "nanwatch")
    except ImportError as exc:
        here = Path(__file__).parent
        if (
            exc.name is not None
            and exc.name.endswith("_chunkcore")
            and not any(here.glob("_chunkcore*.so"))
        ):
            return None, "not built (no C compiler at install time?)"
        return None, f"import error: {exc}"
    where = str(getattr(mod, "__file__", "?"))
    got = getattr(mod, "VERSION", None)
    if got != CORE_VERSION:
        return None, f"stale build {where} (version {got}, this nanwatch needs {CORE_VERSION})"
    return mod, where


_MODULE, _DETAIL = _load()


def status() -> tuple[bool, str]:
    """(compiled core in use, its path or why not): what ``nanwatch doctor`` prints."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return False, f"{PURE_ENV} set"
    return _MODULE is not None, _DETAIL


def _prefix_safe(prefixes: Sequence[str]) -> bool:
    """No prefix can match at the start of a head the core reads (see ``_HEADS``)."""
    import regex

    for p in prefixes:
        try:
            cre = regex.compile(p.encode(), regex.V0)
        except (regex.error, ValueError):
            return False
        if any(cre.match(h, partial=True) is not None for h in _HEADS):
            return False
    return True


def reader(
    pattern: str, head: str | None, groupindex: dict[str, int], prefixes: Sequence[str]
) -> tuple[RowsFn, list[int]] | None:
    """The compiled reader of a columns format and the group index of each of its columns,
    or None when this format is the Python path's (see the module docstring)."""
    on, _ = status()
    if not on or _MODULE is None:
        return None
    if pattern != MMENGINE_PATTERN or head != MMENGINE_HEAD:
        return None
    if set(groupindex) != set(GROUPS) or not _prefix_safe(prefixes):
        return None
    fn: RowsFn = _MODULE.rows
    return fn, [groupindex[g] - 1 for g in GROUPS]


def zip_rows() -> Callable[[type, tuple[Sequence[Any], ...]], list[Any] | None] | None:
    """The compiled ``[cls._make(r) for r in zip(*columns)]`` (None: pure Python)."""
    if _MODULE is None or not status()[0]:
        return None
    fn: Callable[[type, tuple[Sequence[Any], ...]], list[Any] | None] = _MODULE.zip_rows
    return fn


def count_all(chunk: bytes, needles: tuple[bytes, ...]) -> list[int]:
    """``[chunk.count(n) for n in needles]``: in one pass with the compiled core, else one pass
    per needle (the same non-overlapping counts)."""
    if _MODULE is not None and status()[0]:
        got: list[int] | None = _MODULE.count_all(chunk, needles)
        if got is not None:
            return got
    return [chunk.count(n) for n in needles]
