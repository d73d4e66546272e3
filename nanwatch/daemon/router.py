"""Which reader a followed file goes to, and the reading of one chunk by it.

msprobe's monitor output has its own readers: CSV rows (``monitor``) and dumps rewritten in
place, read whole when they change (``snapshot``); every other file is text for the rule packs
(``rules``), whose msprobe alert lines are thinned by the monitor's volume policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Literal

from ..detect.msprobe import MonitorReader
from ..events import Event, Metric
from ..sources import Chunk, SourceRecord
from ..store.metrics import MetricColumns
from ..store.records import JSON
from ..stream import StreamState

if TYPE_CHECKING:  # the engine loads with the first text file (a start that reads none needs none)
    from ..detect import Detector

Route = Literal["rules", "monitor", "snapshot"]


class Router:
    """Routes files to the rule packs or the monitor readers; holds both. ``detector`` may be
    a function that builds it: called when a first text file needs it."""

    def __init__(self, detector: Detector | Callable[[], Detector], monitor: MonitorReader) -> None:
        self._detector: Detector | None = None
        self._make: Callable[[], Detector] | None = None
        if callable(detector):
            self._make = detector
        else:
            self._detector = detector
        self.monitor = monitor

    @property
    def detector(self) -> Detector:
        d = self._detector
        if d is None:
            assert self._make is not None
            d = self._detector = self._make()
        return d

    @detector.setter
    def detector(self, detector: Detector) -> None:
        self._detector = detector

    def detector_counters(self) -> Mapping[str, int]:
        """The detector's counters; none when no text was read (no detector was built)."""
        return self._detector.counters if self._detector is not None else {}

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
