"""The msprobe monitor reader: CSV rows and anomaly dumps -> the same events as the rule packs.

CSV files are appended row by row; the pipeline hands them over through the tailer (complete
lines at committed offsets), so a half-written row is never parsed. An event's key is its row's
byte offset. What a CSV stream must remember (its header, the step and row index it is in, its
tensor families' counts) lives in ``StreamState.msprobe``, persisted with the offset.

``anomaly.json`` is rewritten in place (truncate, then write, under flock) after every step with
anomalies, so offsets mean nothing there: it is re-read whole when its size or mtime changes, a
torn read is retried and otherwise left for the next pass, and each entry's own key
(``{tag}_step_{S}_call_{C}``) is the event key, so re-reading never duplicates.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...events import Event, Metric, format_utc
from ...sources.monitor import MonitorFile, classify
from ...stream import StreamState
from .names import PHASE_OF, locate, parse_tag
from .rows import Layout, guess_layout, is_placeholder_tail, layout, parse_row, tag_of
from .volume import Family, Volume

log = logging.getLogger("nanwatch.msprobe")

ShapeLookup = Callable[[str | None, str, list[int] | None], Mapping[str, Any] | None]
"""(run folder, tensor name, shape) -> extra fields (candidate modules) or None."""

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


class Rewritten(Exception):
    """A dump no longer continues what was read from it: it was started afresh."""


class MonitorReader:
    """Routes monitor files and turns their contents into events (kind ``nan``)."""

    def __init__(self, shapes: ShapeLookup | None = None) -> None:
        self.volume = Volume()
        self.shapes = shapes
        self.counters: dict[str, int] = {"msprobe_bad_rows": 0, "msprobe_json_retries": 0}
        self._json_read: dict[str, float] = {}

    # -- routing ---------------------------------------------------------------------------------

    @staticmethod
    def route(path: str) -> str | None:
        """'csv', 'anomaly', 'ignore' for monitor files; None for everything else (text)."""
        mf = classify(path)
        return None if mf is None else mf.kind

    @staticmethod
    def read_order(rec: Any) -> int:
        """Sort key for reading: text and dumps first (-1), monitor CSVs by their first step."""
        mf = classify(rec.path)
        if mf is None or mf.kind != "csv" or mf.start is None:
            return -1
        return mf.start

    def restore(self, path: str, state: StreamState) -> None:
        """Seed the family counts from a stream known from an earlier run of nanwatch."""
        ms = state.msprobe or {}
        # CSV families are per rank folder, alert-line families per text file
        folder = path if classify(path) is None else _folder(path)
        for tag, fam in (ms.get("fam") or {}).items():
            self.volume.family(folder, tag, fam)

    # -- CSV -------------------------------------------------------------------------------------

    def feed(
        self,
        data: bytes,
        start: int,
        state: StreamState,
        file: str,
        root: str | None = None,
    ) -> tuple[list[Event], list[Metric]]:
        """Complete CSV lines starting at byte ``start`` -> events; updates ``state``."""
        mf = classify(file)
        events: list[Event] = []
        if mf is None or mf.kind != "csv":
            state.line_no += data.count(b"\n")
            return events, []
        ms: dict[str, Any] = dict(state.msprobe or {})
        pos = 0
        line_no = state.line_no
        lay = _cached_layout(ms, mf)
        if lay is None and start == 0 and data.startswith(b"vpp_stage,"):
            nl = data.find(b"\n")
            ms["h"] = data[:nl].decode("utf-8", "replace").strip().split(",")
            lay = _cached_layout(ms, mf)
            pos = nl + 1
            line_no += 1
        if lay is None:
            header = _header_from_disk(file, mf)
            if header is not None:
                ms["h"] = header
                lay = _cached_layout(ms, mf)
        body = data[pos:]
        if lay is None and body:
            first = body[: body.find(b"\n")]
            lay = guess_layout(mf.version, mf.family, first.count(b",") + 1)
            if lay is not None:
                ms["h"] = list(lay.header)
        if lay is None:
            self.counters["msprobe_bad_rows"] += body.count(b"\n")
            state.line_no = line_no + body.count(b"\n")
            state.msprobe = ms
            return events, []
        ctx = _Rows(self, mf, lay, file, root, ms, start + pos, line_no, state.rank)
        ctx.run(body, events)
        state.msprobe = ctx.save()
        state.line_no = line_no + body.count(b"\n")
        return events, []

    def bound(self, events: list[Event], state: StreamState, file: str) -> list[Event]:
        """Alert-line events of a text stream, thinned by the same policy as CSV rows."""
        if not any(e.fields.get("via") == "alert" for e in events):
            return events
        ms: dict[str, Any] = dict(state.msprobe or {})
        fams: dict[str, Any] = dict(ms.get("fam") or {})
        rows: dict[str, Any] = dict(ms.get("r") or {})
        out = []
        for e in events:
            tag = e.fields.get("tag")
            if e.fields.get("via") != "alert" or e.step is None or not isinstance(tag, str):
                out.append(e)
                continue
            key = f"{e.rank}:{tag}"
            fam = self.volume.family(file, key, fams.get(key))
            seen = rows.get(key)
            n_rows = int(seen[1]) if seen and seen[0] == e.step else 0
            decision, _ = self.volume.decide(fam, e.step, n_rows)
            rows[key] = [e.step, n_rows + 1]
            fams[key] = fam.to_list()
            if decision != "drop":
                out.append(e)
        ms.update(fam=fams, r=rows)
        state.msprobe = ms
        return out

    # -- anomaly.json ----------------------------------------------------------------------------

    def snapshot(
        self,
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
            last = self._json_read.get(path, 0.0)
            if time.monotonic() - last < BIG_JSON_INTERVAL:
                return None
        data = self._read_json(path)
        if data is None:
            return None
        self._json_read[path] = time.monotonic()
        entries = list(data.items()) if isinstance(data, dict) else []
        done = int(ms.get("n", 0))
        if not (0 < done <= len(entries) and entries[done - 1][0] == ms.get("last")):
            if done > 0 and not force:
                # rewritten from scratch (msprobe starts every launch with `{}`): a new
                # generation of the file, whose keys may repeat the old one's
                raise Rewritten(path)
            done = 0
        fams: dict[str, Any] = dict(ms.get("fam") or {})
        rows: dict[str, Any] = dict(ms.get("r") or {})
        mf = classify(path)
        folder = _folder(path)
        mtime = format_utc(st.st_mtime)
        events: list[Event] = []
        for key, entry in entries[done:]:
            ev = self._entry_event(path, key, entry, mf, folder, fams, rows, mtime)
            if ev is not None:
                events.append(ev)
        ms.update(
            sig=sig, n=len(entries), last=entries[-1][0] if entries else None, fam=fams, r=rows
        )
        state.msprobe = ms
        return events, st.st_size

    def _read_json(self, path: str) -> Any:
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
            self.counters["msprobe_json_retries"] += 1
            if attempt + 1 < JSON_RETRIES:
                time.sleep(JSON_RETRY_WAIT * (attempt + 1))
        log.info("%s: caught mid-rewrite; will read it again on the next change", path)
        return None

    def _entry_event(
        self,
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
        fam = self.volume.family(folder, tag, fams.get(tag))
        seen = rows.get(tag)
        n_rows = int(seen[1]) if seen and seen[0] == step else 0
        decision, ordinal = self.volume.decide(fam, step, n_rows)
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
            message=_message(fields),
            offset=0,
            key=key,
            file=path,
            rank=rank if isinstance(rank, int) else (mf.rank if mf else parsed.rank),
            step=step,
            stage="train",
            fields=fields,
        )


_CANDIDATE = re.compile(rb"nan|inf")
EMPTY = "!empty"


class _Rows:
    """One chunk of complete CSV lines. Only lines with ``nan``/``inf`` are looked at: finite rows
    cost a byte search. For a candidate, the line before it says whether a finite row of the
    same step (and micro-step) came first (``after_finite``): rows of one write are contiguous.
    """

    def __init__(
        self,
        reader: MonitorReader,
        mf: MonitorFile,
        lay: Layout,
        file: str,
        root: str | None,
        ms: dict[str, Any],
        base: int,
        line_no: int,
        rank: int | None,
    ) -> None:
        self.r, self.mf, self.lay, self.file, self.root, self.ms = reader, mf, lay, file, root, ms
        self.base, self.line_no = base, line_no
        self.rank = mf.rank if mf.rank is not None else rank
        self.fams: dict[str, Any] = dict(ms.get("fam") or {})
        self.rows: dict[str, Any] = dict(ms.get("r") or {})
        k = ms.get("k") or ["", ""]
        self.key: tuple[bytes, ...] = tuple(str(x).encode() for x in k)  # the last line's key
        self.fin = bool(ms.get("f", False))  # a finite row of that key was seen
        self.folder = _folder(file)
        self.mtime: str | None = None
        self._fam: dict[str, Family] = {}

    def _key(self, raw: bytes) -> tuple[tuple[bytes, ...], list[bytes]] | None:
        parts = raw.split(b",", self.lay.split)
        if len(parts) < self.lay.split:
            return None
        lay = self.lay
        return (parts[lay.step], parts[lay.micro] if lay.micro is not None else b""), parts

    def run(self, body: bytes, events: list[Event]) -> None:
        end = -1
        nl_pos = nl_count = 0
        cand_start = -1
        cand_key: tuple[bytes, ...] = ()
        cand_fin = False
        search = _CANDIDATE.search
        while True:
            m = search(body, end + 1)
            if m is None:
                break
            ls = body.rfind(b"\n", 0, m.start()) + 1
            end = body.find(b"\n", m.start())
            raw = body[ls:end]
            nl_count += body.count(b"\n", nl_pos, ls)
            nl_pos = ls
            got = self._key(raw)
            if got is None:
                self.r.counters["msprobe_bad_rows"] += 1
                continue
            key, parts = got
            if ls == 0:
                fin = self.fin if key == self.key else False
            else:
                ps = body.rfind(b"\n", 0, ls - 1) + 1
                if ps == cand_start:
                    fin = cand_fin if key == cand_key else False
                else:
                    prev = self._key(body[ps : ls - 1])
                    fin = prev is not None and prev[0] == key
            verdict = self._row(raw, parts, key, fin, self.line_no + nl_count + 1, ls, events)
            cand_start, cand_key, cand_fin = ls, key, fin or verdict == "finite"
        if body:
            last = body.rfind(b"\n", 0, len(body) - 1) + 1
            if last == cand_start:
                self.key, self.fin = cand_key, cand_fin
            else:
                got = self._key(body[last:-1])
                if got is not None:
                    self.key, self.fin = got[0], True

    def _row(
        self,
        raw: bytes,
        parts: list[bytes],
        key: tuple[bytes, ...],
        fin: bool,
        line: int,
        ls: int,
        events: list[Event],
    ) -> str:
        lay, mf = self.lay, self.mf
        scope = parts[lay.scope].decode("ascii", "replace").strip() if lay.scope is not None else ""
        tag = tag_of(lay, mf.family, scope)
        if tag is None:
            self.r.counters["msprobe_bad_rows"] += 1
            return "bad"
        if is_placeholder_tail(lay, parts[-1], tag):
            return "placeholder"
        try:
            step = int(float(key[0]))
        except ValueError:
            self.r.counters["msprobe_bad_rows"] += 1
            return "bad"
        fam = self._fam.get(tag)
        if fam is None:
            fam = self._fam[tag] = self.r.volume.family(self.folder, tag, self.fams.get(tag))
        seen = self.rows.get(tag)
        n_rows = int(seen[1]) if seen and seen[0] == step else 0
        if self.r.volume.drops(fam, step, n_rows):
            self.rows[tag] = [step, n_rows + 1]
            return "dropped"
        verdict, found = parse_row(lay, raw.decode("utf-8", "replace"), mf.family)
        if verdict == "bad":
            self.r.counters["msprobe_bad_rows"] += 1
        if found is None:
            return verdict
        if verdict == "empty":
            # counted apart from the NaN family: an empty tensor is a clue, not a NaN
            tag = tag + EMPTY
            fam = self._fam.get(tag)
            if fam is None:
                fam = self._fam[tag] = self.r.volume.family(self.folder, tag, self.fams.get(tag))
            seen = self.rows.get(tag)
            n_rows = int(seen[1]) if seen and seen[0] == step else 0
        decision, ordinal = self.r.volume.decide(fam, found.step, n_rows)
        self.rows[tag] = [found.step, n_rows + 1]
        self.fams[tag] = fam.to_list()
        if decision == "drop":
            return verdict
        if self.mtime is None:
            self.mtime = _mtime(self.file)
        fields = found.fields()
        fields.update(via="csv", after_finite=fin, nan_step=ordinal)
        if decision == "sample":
            fields["sampled"] = True
        if self.mtime:
            fields["stream_time"] = self.mtime
        if self.r.shapes is not None and found.tag in _SHAPE_TAGS and verdict != "empty":
            extra = self.r.shapes(self.root, found.tensor, found.shape)
            if extra:
                fields.update(extra)
        kind = "nan"
        if verdict == "empty":
            # stored for the NaN story (an empty input breaks some backward kernels); on its
            # own it is no incident: some models see empty tensors every step
            kind = "data_issue"
            fields.update(reason="empty tensor", incident=False)
        events.append(
            Event(
                kind=kind,
                message=_message(fields),
                offset=self.base + ls,
                file=self.file,
                line=line,
                rank=self.rank,
                step=found.step,
                stage="train",
                fields=fields,
            )
        )
        return verdict

    def save(self) -> dict[str, Any]:
        ms = dict(self.ms)
        ms.update(
            k=[x.decode("ascii", "replace") for x in self.key],
            f=self.fin,
            fam=self.fams,
            r=self.rows,
        )
        ms.pop("i", None)
        return ms


_SHAPE_TAGS = frozenset(
    ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin", "param_updated")
)


def _folder(path: str) -> str:
    return os.path.dirname(path)


def _mtime(path: str) -> str | None:
    try:
        return format_utc(os.stat(path).st_mtime)
    except OSError:
        return None


def _cached_layout(ms: Mapping[str, Any], mf: MonitorFile) -> Layout | None:
    h = ms.get("h")
    if not h:
        return None
    return layout(tuple(h), mf.version)


def _first_line(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 16)
    except OSError:
        return None
    return line if line.endswith(b"\n") else None


def _header_from_disk(path: str, mf: MonitorFile) -> list[str] | None:
    """The header when the stream has none yet: this file's first line, or its first part's."""
    candidates = [path]
    base = mf.base_csv
    if base is not None:
        candidates.append(os.path.join(os.path.dirname(path), base))
    for p in candidates:
        line = _first_line(p)
        if line is not None and line.startswith(b"vpp_stage,"):
            return line.decode("utf-8", "replace").strip().split(",")
    return None


def _message(f: Mapping[str, Any]) -> str:
    bits = [f"msprobe: {f['tensor']} ({f['tag']}"]
    if f.get("shape") is not None:
        bits.append(f", shape {f['shape']}")
    if isinstance(f.get("nans"), (int, float)) and f["nans"]:
        bits.append(f", {f['nans']:g} NaN elements")
    bits.append(") is empty" if f["value"] == "empty" else f") is {f['value']}")
    if f.get("micro_step") is not None:
        bits.append(f" in micro-step {f['micro_step']}")
    return "".join(bits)
