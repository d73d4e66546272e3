"""Lines printed by the in-process companion (``nanwatch.probe``, ``NanwatchHook``).

Each record is ``NANWATCH-<TYPE> <compact JSON>`` anywhere in a line (after a logger's or
launcher's prefix):

- ``FACTS``: run facts (rank, world size, job identity, versions, device, timeouts,
  determinism), merged into ``runs.facts``; no event.
- ``DATA``: a training sample with empty ground truth -> a ``data_issue`` event that opens no
  incident (the NaN story links it).
- ``STAGE``: validation/testing starts or ends -> the stream's stage.
- ``MEMORY``: the device memory summary after an exception; when the exception was an
  out-of-memory error it is an ``oom`` detection, folded into the traceback's report.

The JSON is data from a log: every value is type-checked, strings are capped, unknown keys are
dropped. A record that does not parse is ignored (the line is still an ordinary log line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..events import Event, format_utc

PREFIX = b"NANWATCH-"
TYPES = ("FACTS", "DATA", "STAGE", "MEMORY")
_RECORD = re.compile(r"NANWATCH-(FACTS|DATA|STAGE|MEMORY) (\{.*\})\s*$")
RECORD_MAX = 64 * 1024
_TEXT_MAX = 1000
_KEYS_MAX = 64
_INT_FACTS = ("world_size", "rank", "local_rank")
_STR_FACTS = ("node", "work_dir", "launcher", "backend")
# ``unknown``: facts the process could not tell, each with why (``{"cann": "torch_npu is ..."}``)
_TABLES = ("job", "versions", "device", "timeouts", "determinism", "unknown")
_MEMORY_FIELDS = (
    "device_index",
    "total",
    "free",
    "allocated",
    "reserved",
    "active",
    "inactive_split",
    "peak_allocated",
    "peak_reserved",
    "alloc_retries",
    "ooms",
)
_RANK_KEYS = ("rank", "local_rank", "node")


def line_starts(chunk: bytes) -> set[int]:
    """Starts of the lines of ``chunk`` that hold a record prefix."""
    out = set()
    pos = chunk.find(PREFIX)
    while pos >= 0:
        start = chunk.rfind(b"\n", 0, pos) + 1
        out.add(start)
        end = chunk.find(b"\n", pos)
        if end < 0:
            break
        pos = chunk.find(PREFIX, end)
    return out


def parse(text: str) -> tuple[str, dict[str, Any]] | None:
    """``(type, payload)`` of the record in a decoded line, or None."""
    at = text.find("NANWATCH-")
    if at < 0 or len(text) - at > RECORD_MAX:
        return None  # records are small; a huge line is not one (and is never parsed whole)
    m = _RECORD.match(text, at)
    if m is None:
        return None
    try:
        data = json.loads(m.group(2))
    except ValueError:
        return None
    return (m.group(1), data) if isinstance(data, dict) else None


# -- FACTS --------------------------------------------------------------------------------------


def run_facts(data: Mapping[str, Any]) -> dict[str, Any]:
    """A FACTS payload -> the ``runs.facts`` schema (what cannot be trusted is left out)."""
    out: dict[str, Any] = {}
    for k in _INT_FACTS:
        v = _int(data.get(k))
        if v is not None and v >= 0:
            out[k] = v
    for k in _STR_FACTS:
        t = _text(data.get(k))
        if t:
            out[k] = t
    for k in _TABLES:
        table = data.get(k)
        if isinstance(table, Mapping):
            clean = _table(table, numbers_only=k == "timeouts")
            if clean:
                out[k] = clean
    return out


def run_update(current: Mapping[str, Any], facts: list[dict[str, Any]]) -> dict[str, Any]:
    """What to merge into a run's facts: every rank says the same about the job, but ``rank``,
    ``local_rank`` and ``node`` are those of the lowest rank that announced (rank 0's)."""
    merged: dict[str, Any] = {}
    low = _int(current.get("rank"))
    for f in facts:
        f = dict(f)
        r = _int(f.get("rank"))
        if r is not None and low is not None and r > low:
            for k in _RANK_KEYS:
                f.pop(k, None)
        elif r is not None:
            low = r
        for k, v in f.items():
            if isinstance(v, dict) and isinstance(merged.get(k), dict):
                merged[k] = {**merged[k], **v}
            else:
                merged[k] = v
    return merged


def device_type(facts: Mapping[str, Any]) -> str | None:
    dev = facts.get("device")
    t = dev.get("type") if isinstance(dev, Mapping) else None
    return t if t in ("npu", "cuda", "cpu") else None


# -- STAGE --------------------------------------------------------------------------------------


def stage_after(data: Mapping[str, Any], current: str | None) -> str | None:
    """The stream's stage after a STAGE marker."""
    stage = data.get("stage")
    if stage not in ("train", "val", "test"):
        return current
    if data.get("event") == "start":
        return str(stage)
    if data.get("event") == "end" and stage == "val":
        return "train"  # validation inside training: training resumes
    return current


# -- DATA and MEMORY ----------------------------------------------------------------------------


def data_event(data: Mapping[str, Any], **where: Any) -> Event:
    """A DATA payload -> a ``data_issue`` event (``where``: offset, file, line and the stream's
    rank/epoch/iter/step/stage, used when the payload lacks them)."""
    fields: dict[str, Any] = {"reason": _text(data.get("reason")) or "empty ground truth"}
    image = _text(data.get("image"))
    image_id = _id(data.get("image_id"))
    if image is not None:
        fields["image"] = image
    if image_id is not None:
        fields["image_id"] = image_id
    for k in ("index", "batch_size", "suppressed"):
        v = _int(data.get(k))
        if v is not None:
            fields[k] = v
    images = data.get("images")
    if isinstance(images, list):
        fields["images"] = [x for x in (_id(i) for i in images[:_KEYS_MAX]) if x is not None]
    fields["incident"] = False  # the NaN story names it; on its own it is no failure
    if fields["reason"] == "empty batch":
        size = fields.get("batch_size", "?")
        message = f"every sample of the batch has empty ground truth ({size} samples)"
    else:
        named = image if image is not None else "a sample"
        message = f"{fields['reason']}: {named}" + (
            f" (image_id {image_id})" if image_id is not None else ""
        )
    return _event("data_issue", message, data, fields, where)


def memory_event(data: Mapping[str, Any], **where: Any) -> Event | None:
    """A MEMORY payload after an out-of-memory exception -> an ``oom`` detection; else None."""
    if data.get("oom") is not True:
        return None
    fields: dict[str, Any] = {}
    for k in _MEMORY_FIELDS:
        v = _int(data.get(k))
        if v is not None and v >= 0:
            fields[k] = v
    exc = _text(data.get("exception")) or "out of memory"
    dev = data.get("device")
    if dev in ("npu", "cuda"):
        where = {**where, "device": dev}
    return _event("oom", exc, data, fields, where)


def record_time(data: Mapping[str, Any]) -> str | None:
    """The record's own time (``t``, seconds since the epoch), RFC 3339 UTC."""
    t = data.get("t")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e11:
        return format_utc(float(t))
    return None


def _event(
    kind: str,
    message: str,
    data: Mapping[str, Any],
    fields: dict[str, Any],
    where: Mapping[str, Any],
) -> Event:
    attrs: dict[str, Any] = {}
    for k in ("rank", "epoch", "iter", "step"):
        v = _int(data.get(k))
        attrs[k] = v if v is not None and v >= 0 else where.get(k)
    stage = data.get("stage")
    attrs["stage"] = stage if stage in ("train", "val", "test") else where.get("stage")
    when = record_time(data)
    return Event(
        kind=kind,
        message=message[:_TEXT_MAX],
        offset=where["offset"],
        time=when or where.get("time"),
        file=where.get("file"),
        line=where.get("line"),
        rank=attrs["rank"],
        local_rank=where.get("local_rank"),
        node=where.get("node"),
        epoch=attrs["epoch"],
        iter=attrs["iter"],
        step=attrs["step"],
        stage=attrs["stage"],
        device=where.get("device"),
        fields={"rule": "companion." + kind, **fields},
    )


# -- values from a log are data, not trusted --------------------------------------------------


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().isdigit():
        return int(v.strip())
    return None


def _text(v: Any) -> str | None:
    return v[:_TEXT_MAX] if isinstance(v, str) and v else None


def _id(v: Any) -> str | int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else _text(v)


def _table(table: Mapping[str, Any], *, numbers_only: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in list(table.items())[:_KEYS_MAX]:
        if not isinstance(k, str) or not k:
            continue
        if isinstance(v, bool):
            if not numbers_only:
                out[k[:100]] = v
        elif isinstance(v, (int, float)):
            if v == v and abs(v) != float("inf"):  # NaN/inf are no facts
                out[k[:100]] = v
        elif isinstance(v, str) and v and not numbers_only:
            out[k[:100]] = v[:_TEXT_MAX]
    return out
