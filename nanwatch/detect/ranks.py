"""Who printed a line and which rank it is: the PID a CANN / torch_npu report names, a rank a
report's head or a prefixed traceback lends to the lines after it, a rank a process announced,
and a local rank's global rank from the launcher's facts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ..stream import StreamState
from .bounds import count
from .reports import BLOCK_LINES, Feed

# the process that printed a CANN / torch_npu report: "EI0002: [PID: 3305] ...", "[ERROR]
# 2026-... (PID:3305, Device:5, RankID:-1) ERR00100 ..." (reports of two processes are two reports)
_REPORTER_PID = re.compile(r"(?:\[PID: ?|\(PID: ?)(\d{1,10})[\],]")
RANK_HINT_WINDOW = 40  # lines a rank named by an error line (RankID:8) stays valid


def same_process(state: StreamState, text: str, line_no: int) -> bool:
    """Is ``text`` a later line of the process whose line named the hint rank (its PID)?"""
    return (
        state.hint_rank is not None
        and state.hint_rank_pid is not None
        and line_no != state.hint_rank_line
        and line_no - state.hint_rank_line <= RANK_HINT_WINDOW
        and reporter_pid(text) == state.hint_rank_pid
    )


def reporter_pid(text: str) -> int | None:
    """The PID a CANN / torch_npu report line says printed it, if any."""
    if "PID:" not in text:
        return None
    m = _REPORTER_PID.search(text, 0, 400)
    return int(m.group(1)) if m is not None else None


def other_rank(said_by: Any, rank: Any) -> bool:
    """Two known values that differ: a stage another rank's line named, a PID of another
    process."""
    return said_by is not None and rank is not None and said_by != rank


def global_rank(
    launch: Mapping[str, str] | None, local_rank: int, one_node: bool = True
) -> int | None:
    """A local rank's global rank: ``group_rank * nproc_per_node + local_rank`` when the launcher
    printed both; the local rank itself on one node (``one_node``: nothing says there are
    more); unknown on a job of several nodes."""
    facts = launch or {}
    try:
        nnodes = int(facts.get("nnodes", "1"))
        group = int(facts["group_rank"]) if "group_rank" in facts else None
        nproc = int(facts["nproc_per_node"]) if "nproc_per_node" in facts else None
    except ValueError:
        return local_rank
    if group is not None and nproc is not None:
        return group * nproc + local_rank
    if nnodes > 1 or (group or 0) > 0 or not one_node:
        return None  # a local rank of one of several nodes: which node is not known
    return local_rank  # one node: the local rank is the global one


def record_rank(
    state: StreamState, values: Mapping[str, Any], prefix_attrs: Mapping[str, Any], line_no: int
) -> None:
    """A hint line (a traceback's header or frame) whose prefix names a rank lends it to
    the next unprefixed event of its record; a rank a process's line names is that
    process's (its other lines carry only its pid)."""
    prefix_rank = prefix_attrs.get("rank")
    if prefix_rank is not None and values.get("rank") is None:
        state.hint_rank = prefix_rank
        state.hint_rank_line = line_no
        state.hint_rank_once = True
    pid = prefix_attrs.get("pid")
    if pid is not None and prefix_rank is None and values.get("rank") is not None:
        rank = count(values["rank"])
        if rank is None or rank < 0:
            return  # "RankID:-1": the process does not know its rank
        known = state.pid_ranks or {}
        if known.get(pid) != rank and len(known) < 4096:
            state.pid_ranks = {**known, pid: rank}


def late_rank(value: Any, line_no: int, f: Feed, state: StreamState) -> None:
    """An indented line of a report (a CANN block's continuation) that names the reporting
    rank after the report's first line: the open report without a rank is that rank's."""
    rank = count(value)
    if rank is None:
        return
    idx = f.opened.get("?")
    block = state.blocks.get("?")
    if rank < 0 or idx is None or block is None or str(rank) in state.blocks:
        return
    ev = f.events[idx]
    if ev.rank is not None or line_no - (ev.line or 0) > BLOCK_LINES:
        return
    f.events[idx] = dataclasses.replace(ev, rank=rank)
    state.blocks = {k: v for k, v in state.blocks.items() if k != "?"}
    state.blocks[str(rank)] = block
    del f.opened["?"]
    f.opened[str(rank)] = idx


def announced(state: StreamState, rank: int) -> None:
    """A process announced its rank in this stream: the stream is that rank's, unless
    another rank announces itself in it too (stdout and stderr of several ranks)."""
    if state.announced is None:
        state.announced = rank
        if state.rank is None:
            state.rank = rank
    elif state.announced not in (rank, -1):
        if state.rank == state.announced:
            state.rank = None
        state.announced = -1
