"""The pipeline: sources -> detect -> store -> correlate -> notify. `scan` and `watch` share it.

One thread (the caller's) owns the write connection; the watcher thread only wakes it, the
sender thread only reads and reports back.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .correlate import Change, Correlator
from .detect import Detector, RuleSet, load_rules
from .errors import StoreError
from .events import Event, Metric, now_utc
from .notify.outbox import Outbox, Result, Sender, Sink
from .sources import Chunk, Root, SourceRecord, Tracker, make_roots
from .sources.discover import rank_from_path
from .sources.runs import run_key
from .sources.watcher import Watcher, choose_mode
from .store import Store
from .stream import StreamState

log = logging.getLogger("nanwatch")

BATCH_BYTES = 32 << 20  # commit at least this often during a catch-up
BATCH_EVENTS = 50_000
SAFETY_POLL = 30.0  # seconds between full checks when inotify is trusted


@dataclass
class Stats:
    files: int = 0
    bytes: int = 0
    lines: int = 0
    metrics: int = 0
    events: Counter[str] = field(default_factory=Counter)
    commits: int = 0
    last_commit: float | None = None
    runs: set[int] = field(default_factory=set)
    deliveries: Counter[str] = field(default_factory=Counter)  # "ok" | "failed" | "given_up"


@dataclass
class _Pending:
    chunk: Chunk
    events: list[Event]
    metrics: list[Metric]
    state: StreamState


class Pipeline:
    """Follows the given paths into the store. ``live`` means `watch` (files keep growing)."""

    def __init__(
        self,
        config: Config,
        store: Store,
        paths: Sequence[str],
        *,
        run: str | None = None,
        live: bool = False,
        sinks: Sequence[Sink] = (),
        rules: RuleSet | None = None,
        on_changes: Callable[[list[Change]], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.live = live
        self._run_arg = run
        self.forced_run = run or config.cluster.run
        self.roots = make_roots(list(paths), must_exist=not live)
        self.rules = rules if rules is not None else load_rules(config.detect.rule_dirs)
        self.detector = Detector(self.rules)
        self.tracker = Tracker(self.roots, self._assign_run, known=self._known(), live=live)
        self.correlator = Correlator(store)
        self.sinks = list(sinks)
        self.outbox = Outbox(store, self.sinks) if self.sinks else None
        self.on_changes = on_changes
        self.stats = Stats()
        self._runs: dict[tuple[str, str], int] = {}
        self.wake = threading.Event()
        self._stop: threading.Event | None = None
        self.mode = "scan"
        # called on the writer thread after every commit: a long catch-up still shows progress
        self.on_progress: Callable[[], None] | None = None
        self._reconfigured = False

    def request_stop(self) -> None:
        """Ask a running `watch` to commit what it has read and return (signal-safe)."""
        if self._stop is not None:
            self._stop.set()
        self.wake.set()

    # -- identity --------------------------------------------------------------------------------

    def _assign_run(self, root: Root, path: str) -> int:
        if self.forced_run:
            key = ("<run>", self.forced_run)
            if key not in self._runs:
                self._runs[key] = self.store.run_id(
                    "<run>",
                    self.forced_run,
                    self.forced_run,
                    node=self.config.cluster.node,
                    job=self.config.cluster.job,
                )
            return self._runs[key]
        rk = run_key(root, path)
        k = (rk.root, rk.launch)
        if k not in self._runs:
            self._runs[k] = self.store.run_id(
                rk.root,
                rk.launch,
                rk.name,
                experiment=rk.experiment,
                node=self.config.cluster.node,
                job=self.config.cluster.job,
            )
        return self._runs[k]

    def _known(self) -> list[SourceRecord]:
        """Records from earlier runs of nanwatch for files under these roots."""
        out = []
        for row in self.store.load_sources():
            root = next((r for r in self.roots if r.contains(row["path"])), None)
            if root is None:
                continue
            rec = SourceRecord(
                path=row["path"],
                root=root,
                dev=row["dev"],
                ino=row["ino"],
                run_id=row["run_id"],
                id=row["id"],
                gen=row["gen"],
                offset=row["offset"],
                head_hash=row["head_hash"],
                head_len=row["head_len"],
                tail_hash=row["tail_hash"],
                status=row["status"],
                cutting=bool(row["cutting"]),
                lines_cut=row["lines_cut"],
            )
            rec.state = StreamState.from_json(row["ctx"])
            if rec.state.rank is None:
                rec.state.rank = rank_from_path(rec.path, root.base)
            out.append(rec)
        return out

    # -- one pass --------------------------------------------------------------------------------

    def step(
        self, *, final: bool = False, discover: bool = True, only: Iterable[str] | None = None
    ) -> list[Change]:
        """Read what is new, commit it with its offsets, correlate; return incident changes."""
        if discover:
            self.tracker.discover()
        settled = self.tracker.settle_pending()
        wanted = set(only) | {r.path for r in settled} if only is not None else None
        batch: list[_Pending] = []
        size = 0
        nevents = 0
        for rec in list(self.tracker.records.values()):
            if wanted is not None and rec.path not in wanted:
                continue
            states: dict[int, StreamState] = {}
            for chunk in self.tracker.read(rec, final=final):
                r = chunk.record
                if r.run_id is None:
                    r.run_id = self._assign_run(r.root, r.path)
                st = states.get(id(r))
                if st is None:
                    st = copy.copy(r.state)
                work = copy.copy(st) if chunk.final else st
                events, metrics = self.detector.feed(chunk.data, chunk.start, work, r.path)
                if not chunk.final:
                    states[id(r)] = st
                batch.append(_Pending(chunk, events, metrics, work))
                size += len(chunk.data)
                nevents += len(events)
                if size >= BATCH_BYTES or nevents >= BATCH_EVENTS:
                    self._commit(batch)
                    batch, size, nevents = [], 0, 0
        for rec in self.tracker.drain_vanished():
            self._retire(rec)
        self._commit(batch)
        self._persist_retired()
        changes = self.correlator.process()
        if changes:
            if self.outbox is not None:
                self.outbox.enqueue(changes, immediate=not self.live)
            if self.on_changes is not None:
                self.on_changes(changes)
        return changes

    def _retire(self, rec: SourceRecord) -> None:
        try:
            st = os.fstat(rec.fd) if rec.fd is not None else None
        except OSError:
            st = None
        status = "rotated" if st is not None and st.st_nlink > 0 else "gone"
        self.tracker._retire(rec, status)
        if rec.id is not None:
            self.store.set_source_status(rec.id, status)

    def _persist_retired(self) -> None:
        for rec in self.tracker.retired:
            if rec.id is not None and getattr(rec, "_saved_status", None) != rec.status:
                self.store.set_source_status(rec.id, rec.status)
                rec._saved_status = rec.status  # type: ignore[attr-defined]

    def _commit(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        ingested = now_utc()
        with self.store.transaction():
            for p in batch:
                rec = p.chunk.record
                if p.chunk.final:
                    if rec.id is None:
                        self.store.save_source(
                            rec,
                            offset=rec.offset,
                            tail_hash=rec.tail_hash,
                            head_hash=rec.head_hash,
                            head_len=rec.head_len,
                            cutting=rec.cutting,
                            ctx=rec.state.to_json(),
                        )
                else:
                    self.store.save_source(
                        rec,
                        offset=p.chunk.end,
                        tail_hash=p.chunk.tail_hash,
                        head_hash=p.chunk.head_hash,
                        head_len=p.chunk.head_len,
                        cutting=p.chunk.cutting,
                        ctx=p.state.to_json(),
                    )
                n = self.store.insert_events(rec.run_id, rec.id, p.events, ingested)
                self.stats.metrics += self.store.insert_metrics(rec.run_id, rec.id, p.metrics)
                if n:
                    self.stats.events.update(e.kind for e in p.events)
                self.stats.bytes += len(p.chunk.data)
                self.stats.lines += p.chunk.data.count(b"\n")
                if rec.run_id is not None:
                    self.stats.runs.add(rec.run_id)
        for p in batch:
            if not p.chunk.final:
                self.tracker.committed(p.chunk)
                p.chunk.record.state = p.state
        self.stats.commits += 1
        self.stats.last_commit = time.time()
        if self.on_progress is not None:
            self.on_progress()

    # -- scan ------------------------------------------------------------------------------------

    def scan(self) -> list[Change]:
        """Read every file to its end once (unterminated last lines included)."""
        changes = self.step(final=True)
        self.stats.files = len(self.tracker.records)
        return changes

    def deliver_all(self, *, deadline: float = 600.0) -> int:
        """Deliver every queued notification now (scan --notify); returns what is still queued."""
        if self.outbox is None:
            return 0
        sender = Sender(str(self.store.path), self.sinks)
        reader = Store.open(self.store.path, readonly=True)
        end = time.monotonic() + deadline
        try:
            while time.monotonic() < end:
                sender.deliver_due(reader)
                self._record(sender.drain_results())
                row = self.store.conn.execute(
                    "SELECT count(*), min(due_at) FROM outbox WHERE delivered_at IS NULL"
                ).fetchone()
                if not row[0]:
                    return 0
                wait = max(0.05, min((row[1] or 0) - time.time(), end - time.monotonic()))
                time.sleep(min(wait, 60.0))
        finally:
            reader.close()
        return self.outbox.pending()

    # -- watch -----------------------------------------------------------------------------------

    def watch(
        self,
        stop: threading.Event,
        *,
        on_ready: Callable[[], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        tick: float | None = None,
    ) -> None:
        """Follow the roots until ``stop`` is set; commits everything read before returning.

        ``on_tick`` runs on this (the writer) thread after every pass, at least every ``tick``
        seconds when given: a service's watchdog pings come from here, so a wedged pass stops
        them. ``reconfigure()`` called from ``on_tick`` takes effect before the next pass.
        """
        mode, reason = choose_mode(self.config.sources.mode, self.roots)
        self._stop = stop
        wake = self.wake
        watcher = Watcher(self.roots, wake)
        if mode == "inotify" and not watcher.start():
            mode, reason = "poll", "inotify watches could not be added (see fs.inotify limits)"
        log.info("following %d path(s) by %s (%s)", len(self.roots), mode, reason)
        self.mode = mode
        sender = Sender(str(self.store.path), self.sinks) if self.sinks else None
        if sender is not None:
            sender.start()
        try:
            self.step()
            if on_ready is not None:
                on_ready()
            last_full = time.monotonic()
            while not stop.is_set():
                poll = self.config.sources.poll_interval
                timeout = poll if mode == "poll" else SAFETY_POLL
                if tick is not None:
                    timeout = min(timeout, tick)
                if any(r.status == "pending" for r in self.tracker.records.values()):
                    timeout = min(timeout, 1.0)
                deadline = time.monotonic() + timeout
                while not stop.is_set() and not wake.is_set():
                    # short slices so an external `stop` is seen promptly; no work is done here
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wake.wait(min(left, 0.5))
                wake.clear()
                if stop.is_set():
                    break
                dirty, structural = watcher.take()
                now = time.monotonic()
                full = mode == "poll" or structural or now - last_full >= SAFETY_POLL
                if structural:
                    watcher.rescan_roots()
                try:
                    changes = self.step(discover=full, only=None if full else dirty)
                except StoreError as e:
                    log.error("%s; pausing for %.0fs", e, max(poll, 5.0))
                    stop.wait(max(poll, 5.0))
                    continue
                if full:
                    last_full = now
                if sender is not None:
                    if changes:
                        sender.wake.set()
                    self._record(sender.drain_results())
                if on_tick is not None:
                    on_tick()
                if self._reconfigured:
                    self._reconfigured = False
                    mode = self._rewatch(watcher, mode)
                    sender = self._resend(sender)
                    wake.set()  # read the new sources now
                    last_full = 0.0
            # drain: whatever was written up to now is committed before exit
            self.step()
        finally:
            watcher.stop()
            if sender is not None:
                sender.wake.set()
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and self.outbox is not None:
                    self._record(sender.drain_results())
                    due = self.store.conn.execute(
                        "SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND due_at <= ?",
                        (time.time(),),
                    ).fetchone()[0]
                    if not due:
                        break
                    time.sleep(0.05)
                sender.stop()
                self._record(sender.drain_results())
            self.tracker.close()

    def _record(self, results: list[Result]) -> None:
        """Record delivery results (writer thread) and count them for the metrics."""
        if not results:
            return
        for r in results:
            self.stats.deliveries["ok" if r.ok else "given_up" if r.permanent else "failed"] += 1
        Outbox(self.store, self.sinks).record(results)

    # -- reload ----------------------------------------------------------------------------------

    def reconfigure(
        self,
        config: Config,
        paths: Sequence[str],
        *,
        rules: RuleSet | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        """Swap config, sources, rules and sinks between passes (SIGHUP), keeping every offset.

        Files still covered by a source keep their records (offsets, stream context, run);
        files no longer covered are closed but stay active in the store, so adding them back
        resumes where they stopped; files of new sources resume from their stored offsets.
        """
        roots = make_roots(list(paths), must_exist=not self.live)
        self.config = config
        self.forced_run = self._run_arg or config.cluster.run
        if rules is not None:
            self.rules = rules
            self.detector = Detector(rules)
        if sinks is not None:
            self.sinks = list(sinks)
            self.outbox = Outbox(self.store, self.sinks) if self.sinks else None
        # Tracker and Watcher hold this very list: change it in place.
        self.roots[:] = roots
        for rec in list(self.tracker.records.values()):
            root = self._root_of(rec.path, rec.root)
            if root is None:
                self.tracker.close_fd(rec)
                del self.tracker.records[rec.key]
            else:
                rec.root = root
        kept = []
        for rec in self.tracker.retired:
            root = self._root_of(rec.path, rec.root)
            if root is not None:
                rec.root = root
                kept.append(rec)
        self.tracker.retired = kept
        known_ids = {r.id for r in self.tracker.records.values()} | {r.id for r in kept}
        for rec in self._known():
            if rec.id in known_ids:
                continue
            if rec.status == "active":
                self.tracker.records.setdefault(rec.key, rec)
            else:
                self.tracker.retired.append(rec)
        self._reconfigured = True
        self.wake.set()

    def _root_of(self, path: str, current: Root) -> Root | None:
        if current in self.roots:
            return current
        return next((r for r in self.roots if r.contains(path)), None)

    def _rewatch(self, watcher: Watcher, mode: str) -> str:
        """After a reload: watch new roots, forget old ones, pick the mode again."""
        wanted, reason = choose_mode(self.config.sources.mode, self.roots)
        if wanted == "inotify" and not watcher.sync_roots():
            wanted, reason = "poll", "inotify watches could not be added (fs.inotify limits)"
        if wanted != mode:
            log.info("now following %d path(s) by %s (%s)", len(self.roots), wanted, reason)
        self.mode = wanted
        return wanted

    def _resend(self, sender: Sender | None) -> Sender | None:
        """Hand the new sinks to the sender thread (started when sinks first appear)."""
        if sender is not None:
            # one attribute swap: the sender reads it per row, its in-flight rows stay known
            sender.sinks = {s.name: s for s in self.sinks}
            return sender
        if not self.sinks:
            return None
        sender = Sender(str(self.store.path), self.sinks)
        sender.start()
        return sender

    def run_ids(self) -> list[int]:
        """The runs of every file these paths cover (read now or before)."""
        ids = {r.run_id for r in self.tracker.records.values() if r.run_id is not None}
        ids |= {r.run_id for r in self.tracker.retired if r.run_id is not None}
        return sorted(ids | self.stats.runs)

    def counters(self) -> dict[str, Any]:
        return dict(self.tracker.counters)
