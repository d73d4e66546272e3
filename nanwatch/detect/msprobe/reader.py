"""The msprobe monitor reader: CSV rows and anomaly dumps -> the same events as the rule packs.

CSV files are appended row by row; the pipeline hands them over through the tailer (complete
lines at committed offsets), so a half-written row is never parsed. An event's key is its row's
byte offset. What a CSV stream must remember (its header, the step and row index it is in, its
tensor families' counts) lives in ``StreamState.msprobe``, persisted with the offset.

``anomaly.json`` is rewritten in place: it is read whole when it changes (see ``dump``).
Alert lines in text logs come from the rule pack ``parsers/msprobe.toml``; :meth:`bound` thins
them like CSV rows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...events import Event, Metric
from ...sources.monitor import MonitorFile, classify
from ...stream import StreamState
from .volume import Volume

# the row and dump readers load when a monitor file is first read: a run without msprobe
# output (and `scan` of plain logs) never pays for them
if TYPE_CHECKING:
    from .dump import Rewritten
    from .rows import Layout

__all__ = ["MonitorReader", "Rewritten", "ShapeLookup"]

log = logging.getLogger("nanwatch.msprobe")

ShapeLookup = Callable[[str | None, str, list[int] | None], Mapping[str, Any] | None]
"""(run folder, tensor name, shape) -> extra fields (candidate modules) or None."""


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
        folder = path if classify(path) is None else os.path.dirname(path)
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
        from .csvrows import RowWalker
        from .rows import guess_layout

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
        ctx = RowWalker(self, mf, lay, file, root, ms, start + pos, line_no, state.rank)
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
        from .dump import read_dump

        return read_dump(self, path, state, identity=identity, force=force)


def _cached_layout(ms: Mapping[str, Any], mf: MonitorFile) -> Layout | None:
    h = ms.get("h")
    if not h:
        return None
    from .rows import layout

    return layout(tuple(h), mf.version)


def __getattr__(name: str) -> Any:
    if name == "Rewritten":  # re-exported without loading the dump reader at import
        from .dump import Rewritten

        return Rewritten
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
