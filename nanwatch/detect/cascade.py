"""The overflow cascade: loss-scale overflow notices of one rank, with no step trained between
them, become one ``overflow`` incident when the run of them is long or the scale falls steeply.

A single skipped step is how a dynamic loss scale finds its level; the notices stay quiet events.
The run of notices per rank is kept in the stream state (``overflow_runs``).
"""

from __future__ import annotations

import dataclasses

from ..events import Event
from ..stream import StreamState
from . import progress
from .reports import Feed

_CASCADE_NOTICES = 4  # skipped steps in a row, no step trained between
_CASCADE_FALL = 2.0**4  # the scale's fall from where the run started
_CASCADE_WARMUP_FLOOR = 2.0**10  # start-up calibration ends above this in healthy fp16 runs


def logged_since(ev: Event, state: StreamState, f: Feed, start: int) -> bool:
    """Did a line that prints a loss come between the rank's last overflow notice and this one
    (in this chunk)? Then the run logged a step in between, whatever format no progress rule
    knows (fairseq's "| epoch 093 | loss 3.509 | ..." summary)."""
    run = (state.overflow_runs or {}).get("?" if ev.rank is None else str(ev.rank))
    if run is None or len(run) < 6 or not f.base <= run[5] < f.base + start:
        return False
    floor = f.chunk.find(b"\n", run[5] - f.base) + 1
    if floor <= 0 or floor >= start:
        return False
    logged = progress.before(f.chunk, start, floor=floor)
    return logged is not None and logged.loss


def cascade(ev: Event, state: StreamState, line_no: int, logged: bool = False) -> Event | None:
    """The overflow ``ev`` as an incident when it makes its rank's run of notices with no
    iteration line between (nor a line with a loss: ``logged``), and no scale that grew again,
    long or steep enough: one skipped step is how a dynamic scale finds its level, a scale
    halved step after step is a run that no longer trains. Returned once per run."""
    key = "?" if ev.rank is None else str(ev.rank)
    runs = state.overflow_runs or {}
    scale = ev.fields.get("loss_scale")
    scale = float(scale) if isinstance(scale, (int, float)) else None
    attempted = ev.fields.get("attempted_scale")
    run = runs.get(key)
    if run is not None and (
        logged
        # a step line between two notices trained; a notice that is a step line of its own
        # and names no scale (a logged step whose grad norm is nan) is no step trained between
        or (run[3] < state.progress_line and (state.progress_line < line_no or scale is not None))
        or (scale is not None and run[2] is not None and scale > run[2])
    ):
        run = None  # a step trained in between, or the scale grew back: a new run
    if run is None:
        first = float(attempted) if isinstance(attempted, (int, float)) else scale
        run = [0, first, None, line_no, False]
    notices = int(run[0]) + 1
    first = run[1] if run[1] is not None else scale
    last = scale if scale is not None else run[2]
    fallen = first is not None and last is not None and last > 0 and first / last >= _CASCADE_FALL
    # before the stream's first iteration line, a dynamic scale halving from its initial value
    # (2**16 and more in DeepSpeed, apex and torch) is the scaler calibrating, not a failure:
    # at start-up only a fall below a level training settles above counts
    warming_up = state.progress_line == 0 and (last is None or last > _CASCADE_WARMUP_FLOOR)
    due = not run[4] and not warming_up and (notices >= _CASCADE_NOTICES or fallen)
    if key in runs or len(runs) < 4096:
        state.overflow_runs = {
            **runs,
            key: [notices, first, last, line_no, bool(run[4]) or due, ev.offset],
        }
    if not due:
        return None
    fields = {**ev.fields, "incident": True, "consecutive_overflows": notices}
    if first is not None:
        fields["first_loss_scale"] = first
    message = f"{notices} loss-scale overflows in a row" + (
        f", scale {first:g} -> {last:g}: training is not progressing"
        if first is not None and last is not None
        else ": training is not progressing"
    )
    return dataclasses.replace(ev, message=message, fields=fields)
