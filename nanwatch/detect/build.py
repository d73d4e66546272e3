"""An event from a rule's match on a line: its typed fields, its time, where the run was
(epoch, iter, step, stage: from the line, its progress bar, the stream's hints or the last
logged step before it), which rank printed it, and its message.

``build_event`` is the line engine's one way to make an event; ``risen`` keeps only the events
whose counter grew (a rule's ``rising``).
"""

from __future__ import annotations

import dataclasses
import re
import signal as _signal
from collections.abc import Mapping
from typing import Any

from ..events import DEVICES, Event
from ..stream import StreamState
from . import progress
from .bounds import count
from .context import HINT_WINDOW
from .ranks import RANK_HINT_WINDOW, global_rank, other_rank, reporter_pid
from .reports import Feed
from .rules import FIELD_TYPES, Rule, convert, normalize_stage
from .timestamps import TimeParser

MESSAGE_MAX = 2000
_BAR = re.compile(r"\d%\||\d(?:it/s|s/it)\b")  # a tqdm bar's signs
_INT_ATTRS = ("rank", "local_rank", "epoch", "iter", "step")
_DEVICE_ALIASES = {"gpu": "cuda", "hip": "cuda", "ascend": "npu"}


def build_event(
    times: TimeParser,
    rule: Rule,
    m: Any,
    ms: list[Any],
    text: str,
    raw: str,
    prefix_attrs: Mapping[str, Any],
    state: StreamState,
    line_no: int,
    f: Feed,
    start: int,
) -> Event:
    """The event ``rule``'s match ``m`` (every match: ``ms``) on line ``line_no`` gives;
    ``text`` is what the rule read (the line without its prefixes, with the lines a match
    joined), ``raw`` the whole line. Updates ``state``'s time and the hints it uses up."""
    g = {k: v for k, v in m.groupdict().items() if v is not None}
    attrs, fields = _typed(rule, g)
    if isinstance(fields.get("backend"), str):
        fields["backend"] = fields["backend"].lower()
    code = fields.get("exit_code")
    if isinstance(code, int) and code < 0 and "signal" not in fields:
        try:
            fields["signal"] = _signal.Signals(-code).name
        except ValueError:
            pass
    if "reporter_pid" not in fields:
        pid = reporter_pid(text)
        if pid is not None:
            fields["reporter_pid"] = pid
    # the actor that printed the line (a Ray prefix): its processes are not one report
    if "worker" in prefix_attrs:
        fields.setdefault("worker", prefix_attrs["worker"])
    if "pid" in prefix_attrs:
        fields.setdefault("worker_pid", convert(str(prefix_attrs["pid"]), "int"))
    if rule.all_matches and len(ms) > 1:
        for k in list(fields):
            vals = []
            for mm in ms:
                val = mm.groupdict().get(k)
                if val is not None and val not in vals:
                    vals.append(val)
            if len(vals) > 1:
                fields[k + "s"] = vals
    when: str | None = None
    ts = g.get("ts")
    if ts:
        when = times.parse(ts)
    if when is None:
        when = times.parse(text) or (times.parse(raw) if raw != text else None)
    if when is not None:
        state.last_time = when
    elif state.last_time:
        # tracebacks rarely carry a time: remember the stream's last one for correlation
        fields["stream_time"] = state.last_time
    line_progress = None
    if rule.kind == "nan":
        for k, v in progress.bracketed_fields(text).items():
            attrs.setdefault(k, v)
        # the metric line's own counters and mode, read by its structure (progress.py)
        line_progress = progress.read(text, at=m.end())
        if line_progress is not None and state.progress_line != line_no:
            # (a progress rule that read this very line knows its format better)
            for k in ("epoch", "iter", "step", "rank"):
                v = getattr(line_progress, k)
                if v is not None:
                    attrs.setdefault(k, v)
    elif m.start() > 0 and _BAR.search(text, 0, m.start()):
        # a report glued to the progress bar it interrupted (tqdm prints no newline): the
        # bar's position is where the run was
        glued = progress.read(text[: m.start()])
        if glued is not None:
            for k in ("epoch", "iter", "step"):
                v = getattr(glued, k)
                if v is not None:
                    attrs.setdefault(k, v)
    stage = attrs.get("stage")
    own_rank = prefix_attrs.get("rank", attrs.get("rank"))
    if (
        stage is None
        and state.hint_stage
        and line_no - state.hint_line <= HINT_WINDOW
        and not other_rank(state.hint_stage_rank, own_rank)
    ):
        # the entry script says less than where the stream is now (a marker, a progress line)
        if not (state.hint_weak and state.stage):
            stage = state.hint_stage
        state.hint_stage = None
    f.stage_from_stream = False
    if stage is None and not other_rank(state.stage_rank, own_rank):
        stage = state.stage
        f.stage_from_stream = stage is not None
    if stage is None:
        stage = progress.line_stage(text, line_progress, nonfinite=rule.kind == "nan")
    uncounted = (
        state.epoch is None
        and state.iter is None
        and state.step is None
        and not {"epoch", "iter", "step"} & attrs.keys()
    )
    # the stream knows its epoch but not where in it the run was ("| epoch 027 |" read by
    # a rule, the iteration on a line no rule knows)
    partly = (
        not uncounted
        and state.iter is None
        and state.step is None
        and not {"iter", "step"} & attrs.keys()
    )
    if uncounted or partly or stage is None:
        # a report with no counters (or no mode) of its own, in a stream no progress rule
        # knew: the last logged step before it says where the run was, and in which mode
        floor, last = f.looked if f.looked is not None and f.looked[0] <= start else (0, None)
        nearer = progress.before(f.chunk, start, floor=floor)
        last = nearer or last
        f.looked = (start, last)
        if last is not None:
            if uncounted:
                for k in ("epoch", "iter", "step"):
                    v = getattr(last, k)
                    if v is not None:
                        attrs[k] = v
            elif partly and last.epoch in (None, attrs.get("epoch", state.epoch)):
                for k in ("iter", "step"):
                    v = getattr(last, k)
                    if v is not None:
                        attrs[k] = v
            if stage is None:
                stage = last.stage
    rank = prefix_attrs.get("rank", attrs.get("rank"))
    if rank is not None and state.hint_rank_once and state.hint_rank == rank:
        state.hint_rank = None  # the record that lent its rank ended on its own line
    near = line_no - state.hint_rank_line <= RANK_HINT_WINDOW
    own_local = prefix_attrs.get("local_rank", attrs.get("local_rank"))
    lender = state.hint_rank_pid
    if rank is None and state.hint_rank is not None:
        # a line that names its own (local) rank is about that process, not a neighbour's;
        # either way the record that lent its rank has ended; a report another process
        # printed (another PID) is not the lender's
        if own_local is None and not other_rank(lender, fields.get("reporter_pid")):
            rank = state.hint_rank if near else None
        if state.hint_rank_once or own_local is not None:
            state.hint_rank = None
    if rank is None:
        rank = state.rank
    local_rank = prefix_attrs.get("local_rank", attrs.get("local_rank"))
    if local_rank is None and state.hint_local_rank is not None and near:
        local_rank = state.hint_local_rank
    if local_rank is None:
        local_rank = state.local_rank
    if rank is None and local_rank is not None:
        # a Ray actor's local rank is on one node of a cluster: never a rank by itself
        rank = global_rank(state.launch, local_rank, "worker" not in prefix_attrs)
    message = text.strip()
    if rule.message:
        try:
            # the text as printed ("2.00 GiB", "NCCL") reads better than the typed value
            message = rule.message.format_map(_Missing({**fields, **g}))
        except (KeyError, IndexError, ValueError, AttributeError):
            message = text.strip()
    if len(message) > MESSAGE_MAX:
        message = message[:MESSAGE_MAX] + "…"
    device = attrs.get("device") or _device(prefix_attrs.get("device") or "") or state.device
    return Event(
        kind=str(rule.kind),
        message=message,
        offset=f.base + start,
        time=when,
        file=f.file,
        line=line_no,
        rank=rank,
        local_rank=local_rank,
        node=attrs.get("node", prefix_attrs.get("node", state.node)),
        epoch=attrs.get("epoch", state.epoch),
        iter=attrs.get("iter", state.iter),
        step=attrs.get("step", state.step),
        stage=stage,
        device=device,
        fields={"rule": rule.id, **fields},
    )


def _typed(rule: Rule, g: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A match's values (and the rule's ``set``) typed: the event's attributes (rank, epoch,
    stage, device, node...) and its kind-specific fields (with the rule's ``const``)."""
    attrs: dict[str, Any] = {}
    fields: dict[str, Any] = dict(rule.const)
    for k, v in [*rule.set.items(), *g.items()]:
        if k.startswith("_") or k in ("ts", "iters"):
            continue
        if k in _INT_ATTRS:
            n = count(v)
            if n is None:
                continue
            if n < 0 and k in ("rank", "local_rank"):
                continue  # "RankID:-1": not known to the process that printed it
            attrs[k] = n
        elif k == "stage":
            st = normalize_stage(str(v))
            if st:
                attrs[k] = st
        elif k == "device":
            dev = _device(v)
            if dev:
                attrs[k] = dev
        elif k == "node":
            attrs[k] = str(v)
        else:
            typ = rule.types.get(k) or FIELD_TYPES.get(k, "str")
            fields[k] = convert(v, typ) if isinstance(v, str) else v
    return attrs, fields


def risen(rule_id: str, group: str, m: Any, ev: Event, state: StreamState) -> Event | None:
    """``ev`` with the counter's increase, when the counter ``group`` is above the last value
    this stream printed for the event's rank (the first value counts from 0); else None."""
    try:
        value = int(str(m.group(group)).replace(",", ""))
    except (TypeError, ValueError):
        return None
    key = f"{rule_id}:{'?' if ev.rank is None else ev.rank}"
    known = state.counters or {}
    last = known.get(key, 0)
    if value != known.get(key) and (key in known or len(known) < 4096):
        state.counters = {**known, key: value}  # a restarted run counts from 0 again
    if value <= last:
        return None
    return dataclasses.replace(ev, fields={**ev.fields, f"new_{group}": value - last})


def _device(value: Any) -> str | None:
    v = str(value).strip().lower()
    v = _DEVICE_ALIASES.get(v, v)
    return v if v in DEVICES else None


class _Missing(dict[str, Any]):
    """Message templates name groups that some lines lack: say so."""

    def __missing__(self, key: str) -> str:
        return "unknown"
