"""Records a line opens in the stream state: a traceback (header, frames, final line) or another
multi-line report whose later lines only some rules may read (a rule's ``within``).

A record is kept per rank as ``[name, line, offset, innermost frame, its line]``; an iteration
line, the record's final line, or ``RECORD_LINES`` lines close it. A traceback the text ends
inside (``ended_inside``) is a failure of the process that printed it, at its innermost frame.
"""

from __future__ import annotations

import re
from typing import Any

from ..events import Event
from ..stream import StreamState
from .context import HINT_WINDOW

_FRAME = re.compile(  # a traceback's frame line: its file's name, line and function
    r'File "(?:[^"\n]{0,500}/)?(?P<file>[^"/\n]{1,200})", '
    r"line (?P<line>\d{1,7}), in (?P<func>\S{1,200})"
)
RECORD_LINES = 500  # lines a record (a traceback: header, frames, final line) stays open
FRAME_MAX = 300  # characters of a traceback's innermost frame kept while it is open
CUT_KEY = "cut"  # the event key of a traceback the text ends inside


def open_record(
    state: StreamState, name: str, rank: Any, line_no: int, offset: int, text: str
) -> None:
    """A record's head (or a frame line where no head was read) opens it: [name, line,
    offset, innermost frame, its line]; a frame line inside an open record is its
    innermost so far."""
    key = "?" if rank is None else str(rank)
    old = (state.records or {}).get(key)
    if name.endswith("?"):  # only where no record is open
        if old is not None and line_no - old[1] <= RECORD_LINES:
            if len(old) > 3:
                frame = text.strip()[:FRAME_MAX]
                state.records = {**(state.records or {}), key: [*old[:3], frame, line_no]}
            return
        name = name[:-1]
    if old is not None and old[0] != name and line_no - old[1] <= 1:
        return  # the line before named this record ("Exception ignored in:")
    frame = text.strip()[:FRAME_MAX] if name == "traceback" and text[:1].isspace() else ""
    state.records = {**(state.records or {}), key: [name, line_no, offset, frame, line_no]}


def in_record(state: StreamState, name: str, rank: Any, line_no: int) -> bool:
    """Is a record ``name`` of ``rank`` open at ``line_no``?"""
    rec = (state.records or {}).get("?" if rank is None else str(rank))
    return rec is not None and rec[0] == name and line_no - rec[1] <= RECORD_LINES


def close_record(state: StreamState, rank: Any) -> None:
    """The record of ``rank`` ended (its final line was read)."""
    key = "?" if rank is None else str(rank)
    if state.records and key in state.records:
        state.records = {k: v for k, v in state.records.items() if k != key} or None


def ended_inside(state: StreamState, file: str | None = None) -> list[Event]:
    """What the end of a stream's text says (a scan read it to its end): a traceback it
    ends inside, whose final line never came (the process died while printing it, or the
    log was cut), is a failure of the process that printed it, at its innermost frame.

    A progress line after a traceback closes it (the run went on); a traceback record
    opened more than ``RECORD_LINES`` before the end is over too."""
    out = []
    for key, rec in sorted((state.records or {}).items()):
        if rec[0] != "traceback" or len(rec) < 5:
            continue
        if (state.line_no or 0) - rec[1] > RECORD_LINES:
            continue
        _, line, offset, frame, last = rec[:5]
        pending = state.hint_stage and last - state.hint_line <= HINT_WINDOW
        stage = state.hint_stage if pending else state.stage
        m = _FRAME.search(frame) if frame else None
        where = f"{m['func']} ({m['file']}:{m['line']})" if m else frame
        frame_text = f" (innermost frame: {where})" if where else ""
        rank = int(key) if key != "?" else state.rank
        out.append(
            Event(
                kind="process_failure",
                message=f"Traceback without its final line: the log ends inside it{frame_text}",
                offset=int(offset),
                key=CUT_KEY,
                time=state.last_time,
                file=file,
                line=int(line),
                rank=rank,
                local_rank=state.local_rank,
                node=state.node,
                epoch=state.epoch,
                iter=state.iter,
                step=state.step,
                stage=stage,
                device=state.device,
                fields={"rule": "generic.traceback_cut"},
            )
        )
    return out
