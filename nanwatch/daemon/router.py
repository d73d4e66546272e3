"""Which reader a followed file goes to, and the reading of one chunk by it.

msprobe's monitor output has its own readers: CSV rows (``monitor``) and dumps rewritten in
place, read whole when they change (``snapshot``); every other file is text for the rule packs
(``rules``), whose msprobe alert lines are thinned by the monitor's volume policy.
"""

from __future__ import annotations

from typing import Literal

from ..detect import Detector
from ..detect.msprobe import MonitorReader
from ..events import Event, Metric
from ..sources import Chunk, SourceRecord
from ..store.metrics import MetricColumns
from ..store.records import JSON
from ..stream import StreamState

Route = Literal["rules", "monitor", "snapshot"]


class Router:
    """Routes files to the rule packs or the monitor readers; holds both."""

    def __init__(self, detector: Detector, monitor: MonitorReader) -> None:
        self.detector = detector
        self.monitor = monitor

    def route(self, rec: SourceRecord) -> Route:
        kind = self.monitor.route(rec.path)
        if kind is None:
            return "rules"
        return "snapshot" if kind == "anomaly" else "monitor"

    def read_order(self, rec: SourceRecord) -> int:
        """Monitor CSVs in step order (one file per step range): the first NaN steps first."""
        return self.monitor.read_order(rec)

    def feed(
        self, route: Route, chunk: Chunk, state: StreamState
    ) -> tuple[list[Event], list[Metric] | MetricColumns, list[dict[str, JSON]]]:
        """Events, metrics and run facts of one chunk of complete lines; updates ``state``."""
        rec = chunk.record
        facts: list[dict[str, JSON]] = []
        if route == "rules":
            # iteration lines read as columns stay columns down to the block they are stored in
            events, cols = self.detector.feed_columns(
                chunk.data, chunk.start, state, rec.path, facts=facts
            )
            return self.bound(events, state, rec.path), MetricColumns(*cols), facts
        events, metrics = self.monitor.feed(chunk.data, chunk.start, state, rec.path, rec.root.base)
        return events, metrics, facts

    def bound(self, events: list[Event], state: StreamState, path: str) -> list[Event]:
        """msprobe alert lines of a text stream, thinned like the monitor's CSV rows."""
        return self.monitor.bound(events, state, path) if events else events

    def snapshot(
        self, rec: SourceRecord, state: StreamState, *, force: bool = False
    ) -> tuple[list[Event], int] | None:
        """A dump rewritten in place, read whole if it changed (see ``MonitorReader``)."""
        return self.monitor.snapshot(rec.path, state, identity=rec.key, force=force)
