"""The text of one line: bytes decoded to clean text, the prefixes a launcher or logger put
before it (``[rank6]:``, a Ray actor's ``(Worker pid=961)``) and the attributes they carry, and
whether a line may be the hard-wrapped tail of the line before it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .bounds import PREFIX_LIMIT, count
from .rules import Prefix

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# A line that starts a record of its own, never the wrapped tail of the line before it.
_NEW_RECORD = re.compile(
    r"\s*$|\[|\(\w+ pid=|\d{4}-\d\d|\d\d[:/]\d\d|[IWEF]\d{3,4} |Traceback|\s+File \"|frame #|"
    r"During handling|The above exception|Exception raised from|"
    r"(?:[A-Z][A-Za-z_]+\()?E[A-Z0-9]\d{4}\)?: |"  # a CANN error code heads a record of its own
    # the shell's report that the process ended, in English and in a Chinese locale
    r"(?:Aborted|Segmentation fault|Killed|Bus error|已放弃|段错误|已杀死)(?![\w])"
)
HEAD_SAME = 12  # a line that begins as the line before it did (a logger's or worker's prefix)
WRAP_MIN = 79  # a line at least this long may have been hard-wrapped by a terminal


def starts_record(line: str, nxt: str) -> bool:
    """Does ``nxt`` start a record of its own, or may it be the hard-wrapped tail of ``line``?
    A line that opens as the one before it did (``(VllmWorker TP1 pid=961) ERROR ...`` twice)
    is a record of its own: a wrapped tail never repeats its line's head."""
    return bool(_NEW_RECORD.match(nxt)) or same_head(line, nxt)


def same_head(line: str, nxt: str) -> bool:
    """Does ``nxt`` open as ``line`` does (its first HEAD_SAME characters, not all blank)?"""
    head = line[:HEAD_SAME]
    return len(head) == HEAD_SAME and not head.isspace() and nxt.startswith(head)


def decode_line(raw: bytes) -> str:
    """Bytes of one line -> clean text: UTF-8 (GBK tried when UTF-8 fails), no ANSI, no CR."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        try:
            text = raw.decode("gb18030")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\x00" in text:
        text = text.replace("\x00", "")
    return text.rstrip("\r\n")


def wrapped_head(chunk: bytes, start: int, line: str) -> str | None:
    """The line before ``start`` when ``line`` (which has no prefix) may be its hard-wrapped
    tail: a terminal cut a long ``[rank6]:`` line, and the detection's literal is on the tail."""
    if _NEW_RECORD.match(line):
        return None  # the usual line: a record of its own (a log head, a bracket, a time)
    lo = chunk.rfind(b"\n", 0, start - 1) + 1
    if start - 1 - lo < WRAP_MIN:
        return None
    prev = decode_line(chunk[lo : start - 1])
    if len(prev) < WRAP_MIN or same_head(prev, line):  # (not a record of its own: above)
        return None
    return prev


def strip_prefixes(
    text: str, prefixes: Sequence[Prefix], quick: Any, trace: set[str] | None = None
) -> tuple[str, dict[str, Any]]:
    """``text`` without the prefixes (up to four, in any order) ``prefixes`` match at its
    start, and the attributes they carry; ``quick`` (any prefix at all, or None) rules out the
    usual line with one match. The ids of the prefixes read are added to ``trace``."""
    attrs: dict[str, Any] = {}
    if quick is not None and quick.match(text, 0, PREFIX_LIMIT) is None:
        return text, attrs  # the usual line: no prefix (one match instead of one each)
    read: set[str] = set()  # prefixes that read without stripping (a lookahead): once each
    for _ in range(4):
        for p in prefixes:
            m = p.cre.match(text, 0, PREFIX_LIMIT)
            if m and (m.end() > 0 or (p.id not in read and any(m.groupdict().values()))):
                if not m.end():
                    read.add(p.id)
                for k, v in m.groupdict().items():
                    if v is None or k.startswith("_"):
                        continue
                    if k in ("rank", "local_rank"):
                        n = count(v)
                        if n is not None:
                            attrs.setdefault(k, n)
                    elif k in ("node", "device", "pid", "worker"):
                        attrs.setdefault(k, v)
                text = text[m.end() :]
                if trace is not None:
                    trace.add(p.id)
                break
        else:
            break
    return text, attrs
