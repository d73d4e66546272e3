"""The event vocabulary shared by every stage (see ARCHITECTURE.md, "Vocabulary").

Events are frozen: a detector builds one, the store writes it, nothing mutates it on the way.
"""

from __future__ import annotations

import datetime as _dt
import time as _time
from collections.abc import Iterable, Mapping
from dataclasses import field
from typing import Any, NamedTuple

from ._dc import dataclass

KINDS = (
    "nan",
    "overflow",
    "comm_timeout",
    "comm_error",
    "oom",
    "process_failure",
    "slowdown",
    "data_issue",
)
STAGES = ("train", "val", "test")
PHASES = ("forward", "backward", "reduce", "optimizer", "data")
TAGS = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "exp_avg",
    "exp_avg_sq",
    "param_origin",
    "param_updated",
)
DEVICES = ("npu", "cuda", "cpu")

# Attributes an event carries outside `fields`; a rule's named group with one of these names
# sets the attribute instead of a field.
ATTRIBUTES = ("rank", "local_rank", "node", "epoch", "iter", "step", "stage", "device")


@dataclass(frozen=True, slots=True)
class Event:
    """One detection, keyed in the store by (source, offset, key): re-reading never doubles it."""

    kind: str
    message: str
    offset: int
    key: str = ""
    time: str | None = None
    file: str | None = None
    line: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    node: str | None = None
    epoch: int | None = None
    iter: int | None = None
    step: int | None = None
    stage: str | None = None
    device: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


class Metric(NamedTuple):
    """One logged iteration's numbers (for slowdown detection and plots).

    A named tuple, not a dataclass: a catch-up scan makes one per iteration line (hundreds of
    thousands), and a tuple is built in a third of the time and goes to SQLite as it is.
    """

    offset: int
    rank: int | None
    step: int | None
    epoch: int | None
    iter: int | None
    stage: str | None
    time: str | None
    loss: float | None = None
    grad_norm: float | None = None
    step_time: float | None = None
    data_time: float | None = None
    lr: float | None = None
    memory: float | None = None


def format_utc(ts: float) -> str:
    """RFC 3339 UTC with milliseconds: 2026-11-30T10:00:00.123Z."""
    ms = round(ts * 1000)
    sec, milli = divmod(ms, 1000)
    return _dt.datetime.fromtimestamp(sec, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + (
        f".{milli:03d}Z"
    )


def now_utc() -> str:
    return format_utc(_time.time())


def parse_utc(text: str) -> float:
    """Inverse of :func:`format_utc` (accepts any ISO 8601 with offset or Z)."""
    t = text.replace("Z", "+00:00")
    dt = _dt.datetime.fromisoformat(t)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return dt.timestamp()


def ranks_text(ranks: Iterable[int]) -> str:
    """[0,1,2,3,5] -> '0-3,5'."""
    rs = sorted(set(ranks))
    if not rs:
        return "-"
    parts = []
    start = prev = rs[0]
    for r in rs[1:]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = r
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)
