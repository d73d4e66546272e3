"""msprobe's anomaly dumps (``anomaly_detected/rank{R}/anomaly.json``) and alert texts.

msprobe rewrites the dump in place after every step with anomalies (it opens it with "w", so
truncating, and only then takes its lock), so offsets mean nothing there: it is read whole when
its size or mtime changes, a torn read is retried and otherwise left for the next pass, and each
entry's own key (``{tag}_step_{S}_call_{C}``) is its event's key: re-reading never duplicates.
Entries keep their dict order (new steps are appended), so only new entries are turned into
events unless the file was started afresh.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from typing import TYPE_CHECKING, Any

from ...errors import SourceError
from ...events import Event, format_utc
from ...sources.monitor import MonitorFile, classify
from ...stream import StreamState
from .csvrows import message
from .names import PHASE_OF, locate, parse_tag

if TYPE_CHECKING:
    from .reader import MonitorReader

log = logging.getLogger("nanwatch.msprobe")

# msprobe's alert text, also kept in each dump entry's `message`
ALERT = re.compile(
    r"Rule (?P<rule>\w+) reports anomaly signal in \('(?P<tag>[^']*)', '(?P<op>\w+)'\) at step "
    r"(?P<step>\d+)(?:, current value (?P<value>\S+), history mean (?P<history>[^\s,]+?))?\.?\s*$"
)
_NONFINITE = ("nan", "inf", "-inf", "+inf")
JSON_RETRIES = 3
JSON_RETRY_WAIT = 0.02
BIG_JSON = 16 << 20  # a dump this big is re-read at most every BIG_JSON_INTERVAL seconds
BIG_JSON_INTERVAL = 30.0


def classify_alert(
    op: str, value: str | None, history: str | None, raw_tag: str
) -> tuple[bool, str]:
    """Is an alert (line or dump entry) a real non-finite tensor? (yes, why-not)."""
    if value is None:
        # before msprobe 8.1 the text ends at the step: a placeholder and a NaN tensor read the
        # same, except that None parameter gradients are never reported
        if op in ("nans", "zeros") or raw_tag in ("actv", "actv_grad"):
            return False, "ambiguous"
        return True, ""
    if value.lower() not in _NONFINITE:
        return False, "finite"  # a threshold or turbulence alert, not a NaN
    if op in ("nans", "zeros"):
        return False, "placeholder"  # a real NaN tensor has a finite NaN count and zero ratio
    if history is not None and history.lower() == "nan":
        # a placeholder (its history is NaN from the start) or a tensor NaN since an earlier step
        return False, "placeholder"
    return True, ""


class Rewritten(SourceError):
    """A dump no longer continues what was read from it: it was started afresh (the caller
    reads it again from the start, as a new generation of the same file)."""


def read_dump(
    reader: MonitorReader,
    path: str,
    state: StreamState,
    *,
    identity: tuple[int, int] | None = None,
    force: bool = False,
) -> tuple[list[Event], int] | None:
    """Re-read a dump if it changed: (events, size read), or None (unchanged or torn).

    ``identity`` (device, inode) guards against reading a new file that replaced this one.
    Raises :class:`Rewritten` when the content was started afresh (read it again, ``force``,
    as a new generation).
    """
    ms: dict[str, Any] = dict(state.msprobe or {})
    try:
        st = os.stat(path)
    except OSError:
        return None
    if identity is not None and (st.st_dev, st.st_ino) != identity:
        return None
    sig = [st.st_size, st.st_mtime_ns]
    if not force and ms.get("sig") == sig:
        return None
    if st.st_size > BIG_JSON and not force:
        last = reader._json_read.get(path, 0.0)
        if time.monotonic() - last < BIG_JSON_INTERVAL:
            return None
    data = _read_json(reader, path)
    if data is None:
        return None
    reader._json_read[path] = time.monotonic()
    entries = list(data.items()) if isinstance(data, dict) else []
    done = int(ms.get("n", 0))
    if not (0 < done <= len(entries) and entries[done - 1][0] == ms.get("last")):
        if done > 0 and not force:
            # rewritten from scratch (msprobe starts every launch with `{}`): a new
            # generation of the file, whose keys may repeat the old one's
            raise Rewritten(f"{path}: started afresh; read it again from the start")
        done = 0
    fams: dict[str, Any] = dict(ms.get("fam") or {})
    rows: dict[str, Any] = dict(ms.get("r") or {})
    mf = classify(path)
    folder = os.path.dirname(path)
    mtime = format_utc(st.st_mtime)
    events: list[Event] = []
    for key, entry in entries[done:]:
        ev = _entry_event(reader, path, key, entry, mf, folder, fams, rows, mtime)
        if ev is not None:
            events.append(ev)
    ms.update(sig=sig, n=len(entries), last=entries[-1][0] if entries else None, fam=fams, r=rows)
    state.msprobe = ms
    return events, st.st_size


def _read_json(reader: MonitorReader, path: str) -> Any:
    for attempt in range(JSON_RETRIES):
        try:
            with open(path, "rb") as f:
                try:
                    # msprobe writes under LOCK_EX; a shared lock waits for a complete file
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    pass
                raw = f.read()
            if raw.strip():
                return json.loads(raw)
        except (OSError, ValueError):
            pass
        # msprobe opens with "w" (truncating) before it takes its lock: an empty or cut file
        # is a rewrite in progress
        reader.counters["msprobe_json_retries"] += 1
        if attempt + 1 < JSON_RETRIES:
            time.sleep(JSON_RETRY_WAIT * (attempt + 1))
    log.info("%s: caught mid-rewrite; will read it again on the next change", path)
    return None


def _entry_event(
    reader: MonitorReader,
    path: str,
    key: str,
    entry: Any,
    mf: MonitorFile | None,
    folder: str,
    fams: dict[str, Any],
    rows: dict[str, Any],
    mtime: str,
) -> Event | None:
    if not isinstance(entry, dict):
        return None
    msg = str(entry.get("message") or "")
    m = ALERT.search(msg)
    tag_text = str(entry.get("tag_name") or (m["tag"] if m else ""))
    parsed = parse_tag(tag_text)
    if m is None or parsed is None or parsed.tag is None:
        return None
    ok, _ = classify_alert(m["op"], m["value"], m["history"], parsed.raw_tag)
    if not ok:
        return None
    try:
        raw_step: Any = entry.get("step")
        step = int(raw_step if raw_step is not None else m["step"])
    except (TypeError, ValueError):
        return None
    tag = parsed.tag
    fam = reader.volume.family(folder, tag, fams.get(tag))
    seen = rows.get(tag)
    n_rows = int(seen[1]) if seen and seen[0] == step else 0
    decision, ordinal = reader.volume.decide(fam, step, n_rows)
    rows[tag] = [step, n_rows + 1]
    fams[tag] = fam.to_list()
    if decision == "drop":
        return None
    where = locate(parsed.name, tag)
    call_id = entry.get("call_id")
    value = (m["value"] or "nan").lower()
    fields: dict[str, Any] = {
        "via": "anomaly",
        "tensor": parsed.name,
        "tag": tag,
        "raw_tag": parsed.raw_tag,
        "phase": PHASE_OF[tag],
        "module": where.module,
        "role": where.role,
        "micro_step": parsed.micro_step,
        "call_id": call_id if isinstance(call_id, int) and call_id >= 0 else None,
        "value": "nan" if value.startswith("nan") else value,
        "op": m["op"],
        "alert_rule": m["rule"],
        "history": m["history"],
        "nan_step": ordinal,
        "stream_time": mtime,
    }
    if parsed.vpp is not None:
        fields["vpp_stage"] = parsed.vpp
    if decision == "sample":
        fields["sampled"] = True
    rank = entry.get("rank")
    return Event(
        kind="nan",
        message=message(fields),
        offset=0,
        key=key,
        file=path,
        rank=rank if isinstance(rank, int) else (mf.rank if mf else parsed.rank),
        step=step,
        stage="train",
        fields=fields,
    )
