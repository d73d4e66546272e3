"""Prometheus metrics of a running `watch`: ``[metrics] listen = "127.0.0.1:9464"``.

The writer thread publishes a :class:`Snapshot` (an immutable value, swapped in one
assignment) at most once a second; the HTTP thread turns the latest one into ``nanwatch_*``
families when scraped, adding what only the database knows (open incidents, outbox depth)
through its own read-only connection: WAL readers never block the writer (invariant 5).
Nothing is computed when nobody scrapes.
"""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
from collections.abc import Iterator, Mapping
from dataclasses import field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import MetricsHandler

from .. import __version__
from .._dc import dataclass
from ..config import parse_listen
from ..errors import ConfigError, StoreError
from ..store import DatabaseError, Store
from ..store.outbox import OutboxStore
from ..store.reads import Reads

log = logging.getLogger("nanwatch.metrics")


@dataclass(frozen=True)
class SourceSnap:
    source: str  # the configured PATH it was found under
    path: str
    dev: int
    ino: int
    offset: int  # committed


@dataclass(frozen=True)
class Snapshot:
    """What the writer thread knows, at one instant."""

    mode: str = "starting"
    events: Mapping[str, int] = field(default_factory=dict)
    lines: int = 0
    bytes: int = 0
    metric_rows: int = 0
    sources: tuple[SourceSnap, ...] = ()
    counters: Mapping[str, int] = field(default_factory=dict)
    deliveries: Mapping[str, int] = field(default_factory=dict)
    last_scan: float | None = None
    last_commit: float | None = None
    reloads: Mapping[str, int] = field(default_factory=dict)
    retention: Mapping[str, int] = field(default_factory=dict)


# tracker counter -> (metric name, help)
_TRACKER = {
    "lines_cut": ("nanwatch_lines_cut", "Lines longer than the line limit, cut."),
    "files_binary": ("nanwatch_binaries_skipped", "Files skipped because their content is binary."),
    "rotations": ("nanwatch_rotations", "Rotated or renamed files followed."),
    "truncations": ("nanwatch_truncations", "Files found truncated or rewritten."),
    "unreadable": ("nanwatch_files_unreadable", "Files that could not be opened (permissions)."),
    "lines_capped": (
        "nanwatch_lines_capped",
        "Lines longer than what a rule examines (64 KiB by default); the rest was skipped.",
    ),
    "rule_timeouts": (
        "nanwatch_rule_timeouts",
        "Matches of a rule on a long line that ran out of their time budget (no detection).",
    ),
}


class NanwatchCollector:
    """A prometheus_client collector over the latest snapshot and the database."""

    def __init__(self, db_path: str | os.PathLike[str]) -> None:
        self.db_path = Path(db_path)
        self.snapshot = Snapshot()
        self._reader: Store | None = None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        info = GaugeMetricFamily(
            "nanwatch_info",
            "nanwatch version and how files are followed.",
            labels=["version", "mode"],
        )
        info.add_metric([__version__, s.mode], 1)
        yield info
        ev = CounterMetricFamily(
            "nanwatch_events", "Events detected since start, by kind.", labels=["kind"]
        )
        for kind, n in sorted(s.events.items()):
            ev.add_metric([kind], n)
        yield ev
        yield CounterMetricFamily("nanwatch_read_lines", "Complete lines read.", value=s.lines)
        yield CounterMetricFamily("nanwatch_read_bytes", "Bytes read.", value=s.bytes)
        yield CounterMetricFamily(
            "nanwatch_metric_rows", "Per-iteration metric rows stored.", value=s.metric_rows
        )
        for key, (name, text) in _TRACKER.items():
            yield CounterMetricFamily(name, text, value=s.counters.get(key, 0))
        yield from self._sources(s)
        ok = CounterMetricFamily("nanwatch_deliveries", "Notifications delivered.")
        ok.add_metric([], s.deliveries.get("ok", 0))
        yield ok
        failed = CounterMetricFamily(
            "nanwatch_delivery_failures",
            "Failed delivery attempts (permanent: given up, else retried).",
            labels=["permanent"],
        )
        failed.add_metric(["false"], s.deliveries.get("failed", 0))
        failed.add_metric(["true"], s.deliveries.get("given_up", 0))
        yield failed
        for name, value, text in (
            ("nanwatch_last_scan_timestamp_seconds", s.last_scan, "End of the last full pass."),
            (
                "nanwatch_last_commit_timestamp_seconds",
                s.last_commit,
                "Last commit of events and offsets.",
            ),
        ):
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        rel = CounterMetricFamily("nanwatch_reloads", "Configuration reloads.", labels=["result"])
        for result in ("ok", "failed"):
            rel.add_metric([result], s.reloads.get(result, 0))
        yield rel
        ret = CounterMetricFamily(
            "nanwatch_retention_deleted", "Rows deleted by retention.", labels=["table"]
        )
        for table, n in sorted(s.retention.items()):
            ret.add_metric([table], n)
        yield ret
        yield from self._database()

    def _sources(self, s: Snapshot) -> Iterator[Metric]:
        files: dict[str, int] = {}
        lag: dict[str, int] = {}
        for src in s.sources:
            files[src.source] = files.get(src.source, 0) + 1
            lag.setdefault(src.source, 0)
            try:
                st = os.stat(src.path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (src.dev, src.ino):
                lag[src.source] += max(0, st.st_size - src.offset)
        yield GaugeMetricFamily(
            "nanwatch_files_followed", "Files followed.", value=sum(files.values())
        )
        g = GaugeMetricFamily(
            "nanwatch_source_files", "Files followed, per configured source.", labels=["source"]
        )
        for k, n in sorted(files.items()):
            g.add_metric([k], n)
        yield g
        g = GaugeMetricFamily(
            "nanwatch_source_lag_bytes",
            "Bytes written but not yet read, per configured source.",
            labels=["source"],
        )
        for k, n in sorted(lag.items()):
            g.add_metric([k], n)
        yield g

    def _database(self) -> Iterator[Metric]:
        try:
            if self._reader is None:
                self._reader = Store.open(self.db_path, readonly=True)
            open_ = Reads(self._reader).open_by_kind()
            depth = OutboxStore(self._reader).depth_by_sink()
            sizes = self._reader.size_info()
        except (DatabaseError, StoreError) as e:
            log.warning("metrics: cannot read %s (%s)", self.db_path, e)
            self.close()
            return
        g = GaugeMetricFamily(
            "nanwatch_incidents_open", "Open incidents, by kind.", labels=["kind"]
        )
        for kind, n in open_:
            g.add_metric([kind], n)
        yield g
        g = GaugeMetricFamily(
            "nanwatch_outbox_depth", "Notifications waiting to be delivered.", labels=["sink"]
        )
        for sink, n in depth:
            g.add_metric([sink], n)
        yield g
        g = GaugeMetricFamily("nanwatch_db_bytes", "Database size.", labels=["part"])
        for part in ("used", "free", "file", "wal"):
            g.add_metric([part], sizes[part])
        yield g


class MetricsServer:
    """Serves ``/metrics`` on its own thread; binds in the constructor so errors come at once."""

    def __init__(self, host: str, port: int, collector: NanwatchCollector) -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        # a connection that sends nothing is dropped after ``timeout`` seconds, and holds
        # only its own thread meanwhile: the next scrape is answered at once
        handler: Any = type(
            "_Handler", (MetricsHandler,), {"registry": self.registry, "timeout": 10}
        )

        class _Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True  # a stuck client never delays the daemon's exit

            def server_bind(self) -> None:
                # HTTPServer's own looks the host up in DNS (getfqdn): slow or hanging offline
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = host, int(self.server_address[1])

        self.httpd = _Server((host, port), handler)
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 1.0},
            name="nanwatch-metrics",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host or "0.0.0.0"
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        self._thread.start()
        log.info("serving metrics on %s", self.url)

    def stop(self) -> None:
        """Stop serving; the collector stays (a reload may hand it to a new server)."""
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()


def serve(listen: str, collector: NanwatchCollector, *, where: str) -> MetricsServer:
    """Start a server on ``listen``; ConfigError naming the key when the address is taken."""
    host, port = parse_listen(listen, where=where)
    try:
        server = MetricsServer(host, port, collector)
    except OSError as e:
        raise ConfigError(
            f"{where} = {listen!r}: cannot listen there ({e.strerror or e}); pick a free port "
            "or remove [metrics]"
        ) from None
    server.start()
    return server
