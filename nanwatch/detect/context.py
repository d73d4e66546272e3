"""Stream context: what the lines a context rule reads tell the stream state.

A context rule sets where the stream is (stage, epoch, iter, step, rank, node, device, launch
facts); a hint rule (a traceback frame, a report's head) sets what holds for the next few lines
only: a stage for ``HINT_WINDOW`` lines, a rank for ``ranks.RANK_HINT_WINDOW``. An iteration line
ends every hint, open report and record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..stream import LAUNCH_KEYS, StreamState
from .bounds import count
from .reports import BLOCK_LINES, Feed
from .rules import normalize_stage

HINT_WINDOW = 400  # lines a traceback stage hint stays valid


def set_state(
    state: StreamState,
    values: Mapping[str, Any],
    line_no: int,
    hint: bool,
    weak: bool = False,
) -> None:
    """A context rule's ``values`` at ``line_no``: the stream's state, or (``hint``) what holds
    for the lines after it; a ``weak`` stage hint (the entry script's) never replaces a
    stronger pending one."""
    stage = values.get("stage")
    if stage is not None:
        stage = normalize_stage(str(stage))
    if hint:
        pending = state.hint_stage and line_no - state.hint_line <= HINT_WINDOW
        if stage and not (weak and pending and not state.hint_weak):
            state.hint_stage = stage
            state.hint_line = line_no
            state.hint_weak = weak
        rank = values.get("rank")
        n = count(rank)
        if n is not None:
            # a report head that says its rank is unknown ("RankID:-1") ends the rank an
            # earlier record lent: that rank is a neighbour's, not this record's
            state.hint_rank = n if n >= 0 else None
            state.hint_rank_line = line_no
            state.hint_rank_once = False
        local = count(values.get("local_rank"))
        if local is not None:
            state.hint_local_rank = local
            state.hint_rank_line = line_no
        return
    if stage:
        if stage != state.stage:
            state.hint_stage = None
        state.stage = stage
    for key in ("epoch", "iter", "iters", "step", "rank", "local_rank"):
        v = values.get(key)
        if v is not None and v != "":
            n = count(v)
            if n is None:
                continue
            if n >= 0 or key not in ("rank", "local_rank"):
                setattr(state, key, n)
    for key in ("node", "device"):
        v = values.get(key)
        if v:
            setattr(state, key, str(v))
    if not LAUNCH_KEYS.isdisjoint(values):  # a launch fact (parsers/launch.toml)
        launch = {k: str(v) for k, v in values.items() if k in LAUNCH_KEYS and v}
        if launch:
            state.launch = {**(state.launch or {}), **launch}
    state.follow_step(values.get("step") is not None)


def progressed(state: StreamState, line_no: int) -> None:
    """An iteration line: earlier failure reports and traceback hints are over."""
    state.progress_line = line_no
    state.hint_stage = None
    state.stage_rank = None
    state.hint_rank = None
    state.hint_local_rank = None
    if state.blocks:
        state.blocks = {}
    state.records = None


def late_stage(stage: str, rank: Any, line_no: int, f: Feed, weak: bool) -> None:
    """Frames printed after the report's first line (IPython, a traceback that follows
    another rank's error line): they name its stage too; a loop frame replaces what the
    entry script said."""
    for idx in f.opened.values():
        ev = f.events[idx]
        open_to = ev.stage is None or (idx in f.weak_stage and not weak)
        near = open_to and line_no - (ev.line or 0) <= BLOCK_LINES
        if near and (rank is None or ev.rank is None or ev.rank == rank):
            f.events[idx] = dataclasses.replace(ev, stage=stage)
            if weak:
                f.weak_stage.add(idx)
            else:
                f.weak_stage.discard(idx)
