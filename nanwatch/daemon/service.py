"""`nanwatch watch` as a service: systemd's notify protocol, signals, reload, retention.

Everything runs on the pipeline's writer thread except what cannot: the watcher (wake-ups),
the sender (deliveries), the metrics server (scrapes) and the watchdog. The status line,
reloads and retention happen in ``on_tick``, after a pass of the loop that does the work.
The watchdog pings (WATCHDOG=1) come from a thread of their own, so a long pass (a catch-up,
a commit waiting for another writer) never makes systemd kill a working service; they stop
when the writer thread has shown no progress (a commit, a pass) for ``LIVENESS`` seconds, so
a truly wedged pipeline is still restarted.

Signals: SIGTERM/SIGINT commit what was read and exit 0; SIGHUP reloads the config file
(sources, rules, sinks, retention, metrics address) keeping every offset; a config that does
not validate is logged and the running one stays.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from .._dc import dataclass
from ..config import Config, load_config
from ..correlate import Change
from ..detect import RuleSet, load_rules
from ..errors import ConfigError, NanwatchError
from ..notify.outbox import Sink
from ..sources import make_roots
from ..store import Store
from ..store.reads import Reads
from ..store.retention import Housekeeper, cap_wal
from .pipeline import Pipeline

if TYPE_CHECKING:
    from .prometheus import MetricsServer, NanwatchCollector

log = logging.getLogger("nanwatch.daemon")

# --- systemd's notify protocol (sd_notify(3)) -----------------------------------------------


class Notifier:
    """Datagrams to ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace).

    Without the variable every call is a no-op, so `watch` behaves the same outside systemd.
    """

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self._addr: str | None = None
        self._sock: socket.socket | None = None
        self.watchdog_usec = watchdog_usec
        if address and address[0] in "@/":
            self._addr = "\0" + address[1:] if address[0] == "@" else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # a full receive queue must never stall the work loop: such a message is dropped
            self._sock.setblocking(False)
        elif address:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket; not notifying systemd", address)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Notifier:
        usec: int | None = None
        pid = environ.get("WATCHDOG_PID")
        if not pid or pid == str(os.getpid()):  # the watchdog is meant for this very process
            try:
                usec = int(environ.get("WATCHDOG_USEC", "")) or None
            except ValueError:
                usec = None
        return cls(environ.get("NOTIFY_SOCKET"), watchdog_usec=usec)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the timeout, as sd_watchdog_enabled(3) says."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, *fields: str) -> bool:
        if self._sock is None or self._addr is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode("utf-8", "replace"), self._addr)
        except OSError as e:
            log.debug("notify: %s", e)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Watchdog:
    """WATCHDOG=1 every ``every`` seconds while the work loop lives: ``beat()`` (from the writer
    thread, after each commit and each pass) says it does; no beat for ``liveness`` seconds
    and the pings stop, so systemd restarts the service WatchdogSec later."""

    def __init__(
        self,
        notifier: Notifier,
        *,
        every: float,
        liveness: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.notifier = notifier
        self.every = every
        self.liveness = liveness
        self.clock = clock
        self._beat = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wedged = False

    def beat(self) -> None:
        self._beat = self.clock()  # one float store: safe from any thread

    def tick(self) -> bool:
        """Ping now if the loop lived recently; True when a ping was sent."""
        silent = self.clock() - self._beat
        if silent > self.liveness:
            if not self._wedged:
                self._wedged = True
                log.error(
                    "no progress for %.0f s: the work loop is wedged; no more watchdog pings, "
                    "systemd restarts the service",
                    silent,
                )
            return False
        self._wedged = False
        return self.notifier.send("WATCHDOG=1")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nanwatch-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


# --- logging for the journal ----------------------------------------------------------------

_SECRETS = re.compile(
    r"xox[a-z]-[A-Za-z0-9-]+|hooks\.slack\.com/\S+|(?i:bearer\s+)\S+|(?i:token=)[^\s&]+"
)
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3}


class _Redact(logging.Filter):
    """No secret reaches the journal, whoever logs it (a token in an exception text...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = _SECRETS.sub("<redacted>", text)
        if clean != text:
            record.msg, record.args = clean, None
        return True


class _Journal(logging.Formatter):
    """``<N>`` prefixes: journald stores each line with its level (sd-daemon(3))."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 2 if record.levelno > logging.ERROR else 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())


def _stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in stream.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def setup_logging(verbose: int) -> None:
    """Levels and logger names on stderr; the journal gets priorities instead of timestamps."""
    level = logging.DEBUG if verbose >= 2 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    if _stderr_is_journal():
        handler.setFormatter(_Journal("%(name)s: %(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%Y-%m-%dT%H:%M:%S"
            )
        )
    handler.addFilter(_Redact())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


# --- the one validation point ---------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A configuration that passed :func:`preflight`: what start and reload apply."""

    config: Config
    paths: tuple[str, ...]
    rules: RuleSet
    sinks: tuple[Sink, ...]
    listen: str | None


def preflight(
    config: Config, paths: Sequence[str], make_sinks: Callable[[Config], Sequence[Sink]]
) -> Plan:
    """Everything that can refuse a configuration, at start and on reload alike.

    Raises ConfigError naming the file, the key and the fix. Checks that belong to a part
    (a sink refusing a section it cannot work with, e.g. [slack] without a token) raise from
    that part's constructor, called here through ``make_sinks``.
    """
    targets = tuple(paths) or config.sources.paths
    if not targets:
        raise ConfigError(
            "nothing to watch: pass PATHs or set [sources] paths in the config "
            f"({config.path or 'no --config given'})"
        )
    make_roots(list(targets), must_exist=False)
    for t in targets:
        if not any(c in t for c in "*?[") and not os.path.exists(os.path.expanduser(t)):
            log.warning("%s: does not exist yet; it is followed once it appears", t)
    rules = load_rules(config.detect.rule_dirs)
    sinks = tuple(make_sinks(config))
    return Plan(config, targets, rules, sinks, config.metrics.listen)


# --- the service ----------------------------------------------------------------------------


class Service:
    """`nanwatch watch`: start, tick, reload, stop."""

    STATUS_EVERY = 2.0
    SNAPSHOT_EVERY = 1.0
    # seconds without a commit or a finished pass before the pings stop: far beyond any pass
    # whose work per line is bounded, short enough that a hung node is noticed
    LIVENESS = 300.0

    def __init__(
        self,
        *,
        config_path: Path | None,
        db: Path | None,
        paths: Sequence[str],
        run: str | None,
        make_sinks: Callable[[Config], Sequence[Sink]],
        notifier: Notifier | None = None,
    ) -> None:
        self.config_path = config_path
        self.db_arg = db
        self.paths_arg = tuple(paths)
        self.run_arg = run
        self.make_sinks = make_sinks
        self.notifier = notifier or Notifier.from_environ()
        # pings at most this often: under load ticks come many times a second
        self._ping_gap = min(1.0, (self.notifier.watchdog_interval or 4.0) / 4)
        self.watchdog: Watchdog | None = None
        if self.notifier.watchdog_interval is not None:
            self.watchdog = Watchdog(self.notifier, every=self._ping_gap, liveness=self.LIVENESS)
        self.stop = threading.Event()
        self.pipe: Pipeline | None = None
        # prometheus_client is imported only when [metrics] asks for it
        self.metrics: MetricsServer | None = None
        self.collector: NanwatchCollector | None = None
        self.housekeeper: Housekeeper | None = None
        self.listen: str | None = None
        self.reloads: Counter[str] = Counter()
        self._reload_wanted = False
        self._stopping = False
        self._ready = False
        self._last_ping = 0.0
        self._last_status = 0.0
        self._status = ""
        self._last_snap = 0.0
        self._last_scan: float | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def run(self) -> None:
        config = load_config(self.config_path)
        plan = preflight(config, self.paths_arg, self.make_sinks)
        db_path = self.db_arg if self.db_arg is not None else config.db_path()
        self.db_path = db_path
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            self._run(config, plan, db_path)
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()
            for s, handler in old.items():
                signal.signal(s, handler)

    def _run(self, config: Config, plan: Plan, db_path: Path) -> None:
        store = Store.open(db_path)
        try:
            cap_wal(store)
            self.housekeeper = Housekeeper(store, config.store)
            if plan.listen is not None:
                self.metrics = self._serve(plan.listen)
                self.listen = plan.listen
            pipe = Pipeline(
                config,
                store,
                plan.paths,
                run=self.run_arg,
                live=True,
                sinks=plan.sinks,
                rules=plan.rules,
                on_changes=self._log_changes,
            )
            self.pipe = pipe
            pipe.on_progress = self._on_progress
            log.info(
                "watching %d path(s) with %d rule(s); database %s",
                len(plan.paths),
                len(plan.rules.rules),
                db_path,
            )
            if self.stop.is_set():
                return
            pipe.watch(
                self.stop,
                on_ready=self._on_ready,
                on_tick=self._on_tick,
                tick=self.notifier.watchdog_interval,
            )
            log.info("stopped: everything read is committed")
        finally:
            if not self._stopping:
                self.notifier.send("STOPPING=1")
            if self.metrics is not None:
                self.metrics.stop()
            if self.collector is not None:
                self.collector.close()
            store.close()
            self.notifier.close()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if not self._stopping:
            self._stopping = True
            self.notifier.send("STOPPING=1", "STATUS=stopping: committing what was read")
            log.info("%s: stopping", signal.Signals(signum).name)
        self.stop.set()
        if self.pipe is not None:
            self.pipe.request_stop()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        # the work happens on the writer thread, between two passes
        self._reload_wanted = True
        if self.pipe is not None:
            self.pipe.wake.set()

    # -- hooks on the writer thread --------------------------------------------------------------

    def _on_ready(self) -> None:
        self._beat()
        self._ready = True
        self._last_scan = time.time()
        self._publish(force=True)
        self._status = self._status_line()
        self.notifier.send("READY=1", f"STATUS={self._status}")
        log.info("ready: %s", self._status)

    def _beat(self) -> None:
        if self.watchdog is not None:
            self.watchdog.beat()

    def _on_progress(self) -> None:
        self._beat()
        now = time.monotonic()
        if not self._ready and now - self._last_ping >= self._ping_gap:
            self._last_ping = now
            # a long catch-up before READY: keep the start timeout at bay while commits come
            self.notifier.send(
                "EXTEND_TIMEOUT_USEC=60000000", f"STATUS=catching up: {self._status_line()}"
            )
        self._publish()

    def _on_tick(self) -> None:
        self._beat()
        now = time.monotonic()
        self._last_scan = time.time()
        if self._reload_wanted:
            self._reload_wanted = False
            self._reload()
        more = self.housekeeper is not None and self.housekeeper.step()
        if more and self.pipe is not None and self.pipe.mode != "poll":
            # more to delete: come back after the next pass (cheap unless polling walks the tree)
            self.pipe.wake.set()
        if now - self._last_status >= self.STATUS_EVERY:
            self._last_status = now
            line = self._status_line()
            if line != self._status:
                self._status = line
                self.notifier.send(f"STATUS={line}")
        self._publish(force=True)  # once per pass: the last one before a quiet spell counts

    def _status_line(self) -> str:
        pipe = self.pipe
        if pipe is None:
            return "starting"
        files = len(pipe.tracker.records)
        events = sum(pipe.stats.events.values())
        try:
            incidents: int | str = Reads(pipe.store).open_count()
        except Exception:  # a status line must never stop the loop
            incidents = "?"
        return (
            f"following {files} file(s) by {pipe.mode}; {events} event(s) since start; "
            f"{incidents} open incident(s)"
        )

    def _publish(self, *, force: bool = False) -> None:
        """Hand the metrics server a fresh snapshot (mid-pass: at most once a second)."""
        pipe, collector = self.pipe, self.collector
        now = time.monotonic()
        too_soon = now - self._last_snap < self.SNAPSHOT_EVERY
        if pipe is None or collector is None or (not force and too_soon):
            return
        self._last_snap = now
        from .prometheus import Snapshot, SourceSnap

        collector.snapshot = Snapshot(
            mode=pipe.mode,
            events=dict(pipe.stats.events),
            lines=pipe.stats.lines,
            bytes=pipe.stats.bytes,
            metric_rows=pipe.stats.metrics,
            sources=tuple(
                SourceSnap(r.root.spec, r.path, r.dev, r.ino, r.offset)
                for r in pipe.tracker.records.values()
                if r.status == "active"
            ),
            counters={**pipe.tracker.counters, **pipe.detector.counters},
            deliveries=dict(pipe.stats.deliveries),
            last_scan=self._last_scan,
            last_commit=pipe.stats.last_commit,
            reloads=dict(self.reloads),
            retention=dict(self.housekeeper.deleted) if self.housekeeper else {},
        )

    def _log_changes(self, changes: list[Change]) -> None:
        assert self.pipe is not None
        for ch in changes:
            row = Reads(self.pipe.store).incident(ch.incident_id)
            title = row.incident.title if row else "?"
            run = row.run.name if row and row.run else None
            if run and run not in title:
                title = f"{title} (run {run})"
            level = logging.WARNING if ch.action == "open" else logging.INFO
            verb = {"open": "opened", "resolve": "resolved"}.get(ch.action, "updated")
            log.log(
                level,
                "incident %d %s: %s; see `nanwatch show %d`",
                ch.incident_id,
                verb,
                title,
                ch.incident_id,
            )

    # -- reload ----------------------------------------------------------------------------------

    def _serve(self, listen: str) -> MetricsServer:
        from .prometheus import NanwatchCollector, serve

        if self.collector is None:
            self.collector = NanwatchCollector(self.db_path)
            self._publish(force=True)
        return serve(
            listen, self.collector, where=f"{self.config_path or '<config>'}: [metrics] listen"
        )

    def _reload(self) -> None:
        pipe = self.pipe
        assert pipe is not None
        mono = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notifier.send("RELOADING=1", f"MONOTONIC_USEC={mono}")
        new_server: MetricsServer | None = None
        try:
            config = load_config(self.config_path)
            plan = preflight(config, self.paths_arg, self.make_sinks)
            if plan.listen != self.listen and plan.listen is not None:
                new_server = self._serve(plan.listen)
        except NanwatchError as e:
            self.reloads["failed"] += 1
            log.error("reload refused, the running configuration stays: %s", e)
            self.notifier.send("READY=1", f"STATUS=reload refused ({e}); {self._status_line()}")
            return
        new_db = self.db_arg if self.db_arg is not None else config.db_path()
        if new_db != self.db_path:
            log.warning(
                "db changed to %s: restart nanwatch to use it; still writing %s",
                new_db,
                self.db_path,
            )
        pipe.reconfigure(plan.config, plan.paths, rules=plan.rules, sinks=plan.sinks)
        if self.housekeeper is not None:
            self.housekeeper.reconfigure(plan.config.store)
        if plan.listen != self.listen:
            if self.metrics is not None:
                self.metrics.stop()
            self.metrics, self.listen = new_server, plan.listen
        self.reloads["ok"] += 1
        log.info(
            "reloaded %s: %d path(s), %d rule(s), %d sink(s)",
            self.config_path or "defaults",
            len(plan.paths),
            len(plan.rules.rules),
            len(plan.sinks),
        )
        self._status = self._status_line()
        self.notifier.send("READY=1", f"STATUS={self._status}")
