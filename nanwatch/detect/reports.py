"""Failure reports: a failure is usually reported over several lines (a traceback, an HCCL error
block, a watchdog message and its follow-ups). Detections of one report become one event: the
first line gives its position, the strongest line (the one whose rule is tried first) its kind
and message, every line its missing attributes and fields. Open reports are kept per rank in
the stream state, so a report split over two chunks is still one event."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from .._dc import dataclass
from ..events import Event, Metric
from ..stream import StreamState

BLOCK_LINES = 40  # lines within which detections of one family are one failure report
FAMILY = {"comm_timeout": "comm", "comm_error": "comm"}
# A process failure read by the generic layer (a traceback's last line, a vendor's error code) is
# part of whatever failure report of its rank is open: "ERR00100 PTA call acl api failed" before
# the HCCL code that says what failed, a RuntimeError after an NCCL error. A report it opens takes
# the family of the first specific line that joins it.
_ANY = "*"
_FAILURES = {_ANY, "comm", "oom", "process_failure"}  # a NaN report is not a failure report
_MERGED_ATTRS = ("time", "rank", "local_rank", "node", "epoch", "iter", "step", "stage", "device")
_POSITION_ATTRS = ("epoch", "iter", "step")


@dataclass
class Feed:
    """Scratch space of one ``feed`` call."""

    chunk: bytes
    base: int
    file: str | None
    events: list[Event] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    opened: dict[str, int] = field(default_factory=dict)  # report key -> index in events
    prios: dict[int, int] = field(default_factory=dict)  # event index -> its rule's strength
    skip_to: int = -1  # lines consumed by a multi-line match end here
    first_epoch: tuple[int, int] | None = None  # (line, epoch) where the stream named its first
    facts: list[dict[str, Any]] = field(default_factory=list)  # run facts the lines told
    trace: set[str] | None = None  # ids of the rules that matched, when someone asks
    # events staged by the entry script only, or by the stream's last mode: frames printed after
    # the report's line (a native stack, another record's traceback) may say more
    weak_stage: set[int] = field(default_factory=set)
    stage_from_stream: bool = False  # the event build_event just made took the stream's mode
    # the last look-back for a logged step (progress.before): up to where it read, what it found;
    # the next one reads only the bytes after it, so a storm of reports costs one pass
    looked: tuple[int, Any] | None = None
    # rows read as columns, kept as columns (``feed_columns``): (how many line-engine rows came
    # before them, their columns); None: they go to ``metrics`` as rows
    segments: list[tuple[int, Any]] | None = None


def report(
    ev: Event, prio: int, state: StreamState, line_no: int, f: Feed, *, generic: bool = False
) -> None:
    """Add ``ev`` to the events, or fold it into the open report it belongs to; ``generic``: its
    rule is of the generic tier."""
    family = FAMILY.get(ev.kind, ev.kind)
    if ev.kind == "process_failure" and generic:
        family = _ANY
    blocks = state.blocks
    for k in [k for k, b in blocks.items() if line_no - b[1] > BLOCK_LINES]:
        del blocks[k]
        f.opened.pop(k, None)
    key = "?" if ev.rank is None else str(ev.rank)
    pid = _pid(ev)

    def usable(k: str) -> bool:
        b = blocks.get(k)
        if b is None or b[1] < state.progress_line:
            return False
        if (key == "?" or k == "?") and len(b) > 4 and _other_process(pid, b[4]):
            # a rank-less line of another process (a Ray actor's, a CANN report's PID) starts a
            # report of its own; lines of one rank stay one report whatever PIDs they print
            return False
        return b[0] == family or (_ANY in (b[0], family) and {b[0], family} <= _FAILURES)

    found: str | None = None
    if key != "?":
        found = key if usable(key) else ("?" if usable("?") else None)
    else:
        same = [k for k in blocks if usable(k)]
        if same:
            found = max(same, key=lambda k: blocks[k][1])
    if found is None:
        _open(ev, prio, key, family, line_no, blocks, f)
        return
    b = blocks[found]
    if found in f.opened:
        idx = f.opened[found]
        # ties go to the later line: the final exception line of a traceback says most
        stronger = prio >= f.prios[idx]
        merged = _merge(f.events[idx], ev, stronger)
        f.events[idx] = merged
        if stronger:
            f.prios[idx] = prio
        new_key = "?" if merged.rank is None else str(merged.rank)
        blocks.pop(found)
        f.opened.pop(found)
        fam = b[0] if family == _ANY else family
        blocks[new_key] = [fam, line_no, f.prios[idx], merged.kind, _pid(merged)]
        f.opened[new_key] = idx
    elif prio > b[2] and ev.kind != b[3]:
        # the report's first event was committed with an earlier chunk; a stronger line of
        # another kind (an error that turns out to be a timeout) still gets its own event
        blocks.pop(found)
        _open(ev, prio, key, family, line_no, blocks, f)
    else:
        b[1] = line_no


def _open(
    ev: Event,
    prio: int,
    key: str,
    family: str,
    line_no: int,
    blocks: dict[str, list[Any]],
    f: Feed,
) -> None:
    f.events.append(ev)
    idx = len(f.events) - 1
    f.prios[idx] = prio
    f.opened[key] = idx
    blocks[key] = [family, line_no, prio, ev.kind, _pid(ev)]


def _pid(ev: Event) -> list[int | None]:
    """The processes that printed a detection's line, when it names them: a CANN report head's
    "(PID:2214, ...)", the Ray actor of its prefix ("pid=3120"). A "pid" field is the process a
    line is about (a launcher's killed child), not this."""
    out: list[int | None] = []
    for name in ("reporter_pid", "worker_pid"):
        v = ev.fields.get(name)
        try:
            out.append(None if v is None else int(v))
        except (TypeError, ValueError):
            out.append(None)
    return out


def _other_process(mine: list[int | None], theirs: Any) -> bool:
    if not isinstance(theirs, list):
        return False
    return any(a is not None and b is not None and a != b for a, b in zip(mine, theirs))


def _merge(old: Event, new: Event, stronger: bool) -> Event:
    """One report, two lines: keep the first line's place, fill what it did not say."""
    upd: dict[str, Any] = {}
    # the same notice again (a NaN loss on the next logged step) says where *it* was: the
    # first one's step is not the repeat's
    repeat = old.fields.get("rule") is not None and old.fields.get("rule") == new.fields.get("rule")
    for a in _MERGED_ATTRS:
        if repeat and a in _POSITION_ATTRS:
            continue
        if getattr(old, a) is None and getattr(new, a) is not None:
            upd[a] = getattr(new, a)
    fields = dict(old.fields)
    if stronger:
        upd["kind"] = new.kind
        upd["message"] = new.message
        fields.update(new.fields)
    else:
        for k, v in new.fields.items():
            fields.setdefault(k, v)
    upd["fields"] = fields
    return dataclasses.replace(old, **upd)
