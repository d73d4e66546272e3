"""Walking a chunk of msprobe CSV lines: candidate rows only, one event per kept finding."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...events import Event, format_utc
from ...sources.monitor import MonitorFile
from .rows import Layout, is_placeholder_tail, parse_row, tag_of
from .volume import Family

if TYPE_CHECKING:
    from .reader import MonitorReader

_CANDIDATE = re.compile(rb"nan|inf")
EMPTY = "!empty"


class RowWalker:
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
        self.folder = os.path.dirname(file)
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
            self.mtime = mtime_utc(self.file)
        fields = found.fields()
        fields.update(via="csv", after_finite=fin, nan_step=ordinal)
        if decision == "sample":
            fields["sampled"] = True
        if self.mtime:
            fields["stream_time"] = self.mtime
        if self.r.shapes is not None and found.tag in SHAPE_TAGS and verdict != "empty":
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
                message=message(fields),
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


SHAPE_TAGS = frozenset(
    ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin", "param_updated")
)


def mtime_utc(path: str) -> str | None:
    try:
        return format_utc(os.stat(path).st_mtime)
    except OSError:
        return None


def message(f: Mapping[str, Any]) -> str:
    bits = [f"msprobe: {f['tensor']} ({f['tag']}"]
    if f.get("shape") is not None:
        bits.append(f", shape {f['shape']}")
    if isinstance(f.get("nans"), (int, float)) and f["nans"]:
        bits.append(f", {f['nans']:g} NaN elements")
    bits.append(") is empty" if f["value"] == "empty" else f") is {f['value']}")
    if f.get("micro_step") is not None:
        bits.append(f" in micro-step {f['micro_step']}")
    return "".join(bits)
