"""One pass over the sources: read what is new, detect, commit it with its offsets, correlate.

`scan` is one pass to the end of every file; `watch` (``pipeline``) repeats passes as files
change. The caller's thread owns the write connection.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .correlate import Change, Correlator
from .correlate.chains import Timeouts
from .correlate.knowledge import Knowledge
from .detect import Detector, RuleSet, load_rules
from .detect.companion import run_update
from .detect.msprobe import MonitorReader
from .detect.msprobe.reader import Rewritten
from .detect.pool import DetectorPool, Done, usable_workers
from .errors import StoreError
from .events import Event, Metric, now_utc
from .notify.outbox import Outbox, Sink
from .shapes import ShapeResolver
from .sources import Chunk, Root, SourceRecord, Tracker, make_roots
from .sources.discover import rank_from_path
from .sources.identity import rank_fill, refresh, this_node
from .sources.runs import run_key
from .store import Store
from .stream import StreamState

log = logging.getLogger("nanwatch")

BATCH_BYTES = 16 << 20  # commit at least this often during a catch-up
BATCH_EVENTS = 50_000
POOL_MIN_BYTES = 32 << 20  # a scan reads more text than this: detect in worker processes
# watch: a pass that committed nothing correlates at most this often (quiet incidents still
# resolve on time), and step times are looked at for slowdowns at most every SLOWDOWN_GAP s
# and with at most SLOWDOWN_SHARE of the time (a long run's history is reread each time)
QUIET_CORRELATE = 60.0
SLOWDOWN_GAP = 5.0
SLOWDOWN_SHARE = 0.02


@dataclass
class Stats:
    files: int = 0
    bytes: int = 0
    lines: int = 0
    metrics: int = 0
    events: Counter[str] = field(default_factory=Counter)
    deliveries: Counter[str] = field(default_factory=Counter)  # "ok" | "failed" | "given_up"
    commits: int = 0
    last_commit: float | None = None
    runs: set[int] = field(default_factory=set)


@dataclass
class _Pending:
    chunk: Chunk
    events: list[Event]
    metrics: list[Metric] | list[tuple[Any, ...]]  # rows from a detection worker are tuples
    state: StreamState
    size: int = 0  # bytes read (the chunk may no longer hold them)
    lines: int = 0
    facts: list[dict[str, Any]] = field(default_factory=list)  # run facts the lines told


class _Batch:
    """Pending chunks of one pass, committed together once they are big enough."""

    def __init__(self, commit: Callable[[list[_Pending]], None]) -> None:
        self.commit = commit
        self.items: list[_Pending] = []
        self.size = 0
        self.events = 0

    def add(self, p: _Pending) -> None:
        self.items.append(p)
        self.size += p.size
        self.events += len(p.events)
        if self.size >= BATCH_BYTES or self.events >= BATCH_EVENTS:
            self.flush()

    def flush(self) -> None:
        items, self.items, self.size, self.events = self.items, [], 0, 0
        self.commit(items)


@contextlib.contextmanager
def _ids_undone(records: Iterable[SourceRecord]) -> Iterator[None]:
    """Records given a row id by a transaction that rolled back lose it again: the row is
    gone, and the id may be handed to another file by the next insert."""
    fresh = [rec for rec in records if rec.id is None]
    try:
        yield
    except BaseException:
        for rec in fresh:
            rec.id = None
        raise


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


class _Pooled:
    """A pool's ordered results, looked at one ahead, with the stream index of each record."""

    def __init__(
        self, pool: DetectorPool, results: Iterator[tuple[int, Done]], texts: list[SourceRecord]
    ) -> None:
        self.pool = pool
        self.results = results
        self.index = {id(r): i for i, r in enumerate(texts)}
        self._head: tuple[int, Done] | None = None

    def peek(self) -> tuple[int, Done] | None:
        if self._head is None:
            self._head = next(self.results, None)
        return self._head

    def next(self) -> None:
        self._head = None

    def close(self) -> None:
        self.pool.close()


class Passes:
    """Reads the given paths into the store, one pass at a time. ``live`` means the files keep
    growing (`watch`)."""

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
        self.monitor = MonitorReader(ShapeResolver(config.shapes.checkpoint).lookup)
        self.tracker = Tracker(
            self.roots, self._assign_run, known=self._known(), next_gen=store.next_gen, live=live
        )
        for rec in [*self.tracker.records.values(), *self.tracker.retired]:
            self.monitor.restore(rec.path, rec.state)
        self.correlator = Correlator(
            store,
            timeouts=Timeouts(config.knowledge.hccl_exec_timeout, config.knowledge.nccl_timeout),
            knowledge=Knowledge.load(
                config.knowledge.dirs, cann_version=config.knowledge.cann_version
            ),
            resolve_after=config.alerts.resolve_after if live else None,
        )
        self.sinks = list(sinks)
        self.outbox = Outbox(store, self.sinks) if self.sinks else None
        self.on_changes = on_changes
        self.stats = Stats()
        self._runs: dict[tuple[str, str], int] = {}
        # runs whose cluster identity (job, run, node) must be derived again after this pass
        self._dirty_runs: set[int] = set()
        self._launch: dict[int, dict[str, str]] = {}  # what each run's logs printed (launch)
        self.wake = threading.Event()
        self._stop: threading.Event | None = None
        self._stop_by: float | None = None  # monotonic time after which reading stops
        self.mode = "scan"
        self.paused: str | None = None  # why the database could not be written, while it can't
        # called on the writer thread after every commit: a long catch-up still shows progress
        self.on_progress: Callable[[], None] | None = None
        self._reconfigured = False
        # when events count as read (their ingested_at); a replay passes its simulated clock
        self.now_utc: Callable[[], str] = now_utc
        self._correlated = float("-inf")  # when the correlator last ran (monotonic)
        # a batch read and detected whose commit the database refused (disk full): the next
        # pass writes it before reading anything, so a retry costs a commit, not a re-read
        self._unsaved: list[_Pending] = []
        self._next_slowdowns = 0.0

    # -- identity --------------------------------------------------------------------------------

    def _assign_run(self, root: Root, path: str) -> int:
        if self.forced_run:
            key = ("<run>", self.forced_run)
            if key not in self._runs:
                self._runs[key] = self.store.run_id(
                    "<run>",
                    self.forced_run,
                    self.forced_run,
                    node=this_node(self.config.cluster.node),
                )
                self._dirty_runs.add(self._runs[key])
            return self._runs[key]
        rk = run_key(root, path)
        k = (rk.root, rk.launch)
        if k not in self._runs:
            self._runs[k] = self.store.run_id(
                rk.root,
                rk.launch,
                rk.name,
                experiment=rk.experiment,
                node=this_node(self.config.cluster.node),
            )
            self._dirty_runs.add(self._runs[k])
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
        if self._unsaved:
            unsaved, self._unsaved = self._unsaved, []
            self._commit(unsaved)  # refused again: kept again, and nothing else is read
        if discover:
            self.tracker.discover()
        if only is not None:
            only = self.tracker.touched(only)
        settled = self.tracker.settle_pending()
        wanted = set(only) | {r.path for r in settled} if only is not None else None
        commits = self.stats.commits
        batch = _Batch(self._commit)
        # monitor CSVs in step order (one file per step range): the first NaN steps come first
        records = [
            rec
            for rec in sorted(self.tracker.records.values(), key=self.monitor.read_order)
            if wanted is None or rec.path in wanted
        ]
        pooled = self._pooled(records, final)
        try:
            for rec in records:
                # monitor output has its own readers; everything else goes through the rule packs
                route = self.monitor.route(rec.path)
                if route == "anomaly":
                    pending = self._snapshot(rec)
                    if pending is not None:
                        batch.add(pending)
                elif route is None and pooled is not None:
                    self._take_pooled(rec, pooled, batch)
                else:
                    self._read(rec, route, final, batch)
        finally:
            if pooled is not None:
                pooled.close()
        # commit first: a decision about a renamed or copied file below must see every offset
        # this pass moved (a rotated copy resumes where its twin's committed bytes end)
        batch.flush()
        # a wake-up with nothing to read (a watchdog tick) has no file to look for: renames and
        # deletions come as structural events, which make the pass a full one
        idle = wanted is not None and not wanted
        vanished = [] if idle else self.tracker.drain_vanished()
        if vanished or self.tracker.suspects:
            # a path that no longer shows its file: renamed (a rotation, maybe during this very
            # pass) or gone? Only a walk of the roots can tell; a renamed file is followed under
            # its new name (and read on the next pass), not retired.
            self.tracker.discover()
            vanished = self.tracker.drain_vanished()
            self.wake.set()  # the next pass reads the renamed files' new bytes
        self.tracker.retire_suspects()
        for rec in vanished:
            self._retire(rec)
        self._persist_records()
        if self._dirty_runs:
            with self.store.transaction():
                refresh(self.store, self.config.cluster, self._dirty_runs, run=self.forced_run)
            self._dirty_runs.clear()
        changes = self._correlate(self.stats.commits != commits)
        if changes:
            if self.outbox is not None:
                self.outbox.enqueue(changes, immediate=not self.live)
            if self.on_changes is not None:
                self.on_changes(changes)
        return changes

    def _correlate(self, committed: bool) -> list[Change]:
        if not self.live:
            return self.correlator.process(live=False)
        now = time.monotonic()
        # nothing new (a watchdog tick, a wake-up that found nothing): the correlator
        # still runs now and then so that quiet incidents resolve on time
        quiet = QUIET_CORRELATE
        if self.correlator.resolve_after:
            quiet = min(quiet, self.correlator.resolve_after / 4)
        if not committed and now - self._correlated < quiet:
            return []
        slowdowns = now >= self._next_slowdowns
        t0 = time.perf_counter()
        changes = self.correlator.process(live=True, slowdowns=slowdowns)
        if slowdowns:
            spent = time.perf_counter() - t0
            self._next_slowdowns = now + max(SLOWDOWN_GAP, spent / SLOWDOWN_SHARE)
        self._correlated = now
        return changes

    def _read(self, rec: SourceRecord, route: str | None, final: bool, batch: _Batch) -> None:
        """Read a record's new chunks and detect in this process."""
        monitor_feed = None if route is None else self._monitor_feed(rec.root)
        states: dict[int, StreamState] = {}
        for chunk in self.tracker.read(rec, final=final):
            if self._stop_by is not None and time.monotonic() > self._stop_by:
                break  # stopping: what was read is committed, the rest waits for the next start
            if chunk.final and route is not None:
                continue  # an unterminated CSV row may be half-written: never parsed
            r = chunk.record
            if r.run_id is None:
                r.run_id = self._assign_run(r.root, r.path)
            st = states.get(id(r))
            if st is None:
                st = copy.copy(r.state)
            work = copy.copy(st) if chunk.final else st
            facts: list[dict[str, Any]] = []
            if route is None:
                events, metrics = self.detector.feed(
                    chunk.data, chunk.start, work, r.path, facts=facts
                )
                if events:
                    events = self.monitor.bound(events, work, r.path)  # msprobe alert lines
            else:
                assert monitor_feed is not None
                events, metrics = monitor_feed(chunk.data, chunk.start, work, r.path)
            if not chunk.final:
                states[id(r)] = st
            size, lines = len(chunk.data), chunk.data.count(b"\n")
            # the batch keeps what the commit needs, not the bytes (memory stays flat)
            light = copy.copy(chunk)
            light.data = b""
            batch.add(_Pending(light, events, metrics, work, size, lines, facts))

    def _pooled(self, records: list[SourceRecord], final: bool) -> _Pooled | None:
        """Worker processes for the rule packs, when a scan has enough text to read."""
        if self.live or not final:
            return None
        texts = [r for r in records if self.monitor.route(r.path) is None]
        todo = [n for r in texts if r.status == "active" and (n := _size(r.path) - r.offset) > 0]
        if len(todo) < 2 or sum(todo) < POOL_MIN_BYTES:
            return None
        workers = min(usable_workers(), len(todo))
        if workers < 2:
            return None
        pool = DetectorPool(self.detector, workers)
        return _Pooled(pool, pool.ordered(self.tracker.read(r, final=final) for r in texts), texts)

    def _take_pooled(self, rec: SourceRecord, pooled: _Pooled, batch: _Batch) -> None:
        """The results of one text record, detected in a worker, in their serial order."""
        index = pooled.index[id(rec)]
        msprobe: dict[int, dict[str, Any] | None] = {}
        while True:
            got = pooled.peek()
            if got is None or got[0] != index:
                return
            pooled.next()
            chunk, size, lines, events, metrics, state, facts = got[1]
            r = chunk.record
            if r.run_id is None:
                r.run_id = self._assign_run(r.root, r.path)
            # msprobe alert-line counts live in the state but are kept here, not in the worker
            state.msprobe = msprobe.get(id(r), r.state.msprobe)
            if events:
                events = self.monitor.bound(events, state, r.path)
            if not chunk.final:
                msprobe[id(r)] = state.msprobe
            batch.add(_Pending(chunk, events, metrics, state, size, lines, facts))

    def _monitor_feed(
        self, root: Root
    ) -> Callable[[bytes, int, StreamState, str], tuple[list[Event], list[Metric]]]:
        def feed(
            data: bytes, start: int, state: StreamState, file: str
        ) -> tuple[list[Event], list[Metric]]:
            return self.monitor.feed(data, start, state, file, root.base)

        return feed

    def _identify(self, run_id: int | None, events: list[Event], state: StreamState) -> list[Event]:
        """Node, global and local rank on every event: this node unless the line named one;
        ranks completed from each other with what the launcher printed (sources/identity.py)."""
        if not events:
            return events
        launch = dict(self._run_launch(run_id))
        launch.update(state.launch or {})
        node = this_node(self.config.cluster.node)
        out = []
        for e in events:
            rank, local = rank_fill(e.rank, e.local_rank, launch)
            if e.node is None or rank != e.rank or local != e.local_rank:
                e = dataclasses.replace(e, node=e.node or node, rank=rank, local_rank=local)
            out.append(e)
        return out

    def _run_launch(self, run_id: int | None) -> dict[str, str]:
        if run_id is None:
            return {}
        hit = self._launch.get(run_id)
        if hit is None:
            row = self.store.conn.execute(
                "SELECT json_extract(facts, '$.launch') FROM runs WHERE id = ?", (run_id,)
            ).fetchone()
            hit = json.loads(row[0]) if row and row[0] else {}
            self._launch[run_id] = hit
        return hit

    def _snapshot(self, rec: SourceRecord) -> _Pending | None:
        """A file rewritten in place (msprobe's anomaly.json): read whole when it changed."""
        if rec.status != "active":
            return None
        state = copy.copy(rec.state)
        try:
            got = self.monitor.snapshot(rec.path, state, identity=rec.key)
        except Rewritten:
            rec = self.tracker.restart_generation(rec, "rewritten from scratch")
            state = copy.copy(rec.state)
            got = self.monitor.snapshot(rec.path, state, identity=rec.key, force=True)
        if got is None:
            return None
        events, size = got
        if rec.run_id is None:
            rec.run_id = self._assign_run(rec.root, rec.path)
        # offset = the size read; no tail checksum: the bytes before it are rewritten each time
        return _Pending(Chunk(rec, b"", 0, size, None, None, 0, False), events, [], state)

    def _retire(self, rec: SourceRecord) -> None:
        try:
            st = os.fstat(rec.fd) if rec.fd is not None else None
        except OSError:
            st = None
        status = "rotated" if st is not None and st.st_nlink > 0 else "gone"
        self.tracker._retire(rec, status)
        if rec.id is not None:
            self.store.set_source_status(rec.id, status)

    def _save_as_is(self, rec: SourceRecord) -> None:
        """Store a record with its offset and state as they are in memory."""
        self.store.save_source(
            rec,
            offset=rec.offset,
            tail_hash=rec.tail_hash,
            head_hash=rec.head_hash,
            head_len=rec.head_len,
            cutting=rec.cutting,
            ctx=rec.state.to_json(),
        )

    def _persist_records(self) -> None:
        """Every decision about a file (a new one, a rotated copy resuming at byte N, a new
        generation after truncation, a retirement) is stored even when no bytes came with it,
        so a restart makes the same decision."""
        # (a file still empty under a rotated name waits: it may be a copy being written)
        active = [
            rec
            for rec in self.tracker.records.values()
            if rec.status == "active"
            and not rec.unjudged
            and (rec.id is None or rec.renamed or rec.resumed)
        ]
        retired = [
            rec
            for rec in self.tracker.retired
            if rec.id is not None and getattr(rec, "_saved_status", None) != rec.status
        ]
        if not active and not retired:
            return  # nothing to write: no transaction either (the idle daemon's usual pass)
        with _ids_undone(active), self.store.transaction():
            for rec in active:
                if rec.id is not None and rec.renamed:
                    self.store.execute(
                        "UPDATE sources SET path = ? WHERE id = ?", (rec.path, rec.id)
                    )
                    rec.renamed = False
                if rec.id is None or rec.resumed:
                    self._save_as_is(rec)
                    rec.resumed = False
            for rec in retired:
                assert rec.id is not None
                self.store.set_source_status(rec.id, rec.status)
                rec._saved_status = rec.status  # type: ignore[attr-defined]

    def _commit(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        try:
            with _ids_undone([p.chunk.record for p in batch]):
                self._write(batch)
        except StoreError:
            self._unsaved = batch
            raise

    def _write(self, batch: list[_Pending]) -> None:
        ingested = self.now_utc()
        counted: Counter[str] = Counter()
        metrics = 0
        with self.store.transaction():
            # what launchers printed first: a rank's events read in the same batch as the
            # launcher's log get their local ranks from it
            for p in batch:
                rec = p.chunk.record
                if rec.run_id is None:
                    continue
                self._dirty_runs.add(rec.run_id)
                if p.state.launch and p.state.launch != rec.state.launch:
                    self.store.update_run_facts(rec.run_id, {"launch": p.state.launch})
                    self._launch.pop(rec.run_id, None)
            for p in batch:
                rec = p.chunk.record
                if p.chunk.final:
                    if rec.id is None:
                        self._save_as_is(rec)
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
                if p.facts and rec.run_id is not None:
                    self._record_facts(rec.run_id, p.facts)
                events = self._identify(rec.run_id, p.events, p.state)
                n = self.store.insert_events(rec.run_id, rec.id, events, ingested)
                metrics += self.store.insert_metrics(rec.run_id, rec.id, p.metrics)
                if n:
                    counted.update(e.kind for e in p.events)
                if rec.run_id is not None:
                    # a run's start and end as its logs tell them (`runs`, datasette)
                    self.store.widen_run_span(
                        rec.run_id, [e.time for e in events] + [m[6] for m in p.metrics]
                    )
        # counted once committed: a refused batch is written again later
        self.stats.events.update(counted)
        self.stats.metrics += metrics
        for p in batch:
            self.stats.bytes += p.size
            self.stats.lines += p.lines
            if p.chunk.record.run_id is not None:
                self.stats.runs.add(p.chunk.record.run_id)
        for p in batch:
            if not p.chunk.final:
                self.tracker.committed(p.chunk)
                p.chunk.record.state = p.state
        self.stats.commits += 1
        self.stats.last_commit = time.time()
        if self.on_progress is not None:
            self.on_progress()

    def _record_facts(self, run_id: int, facts: list[dict[str, Any]]) -> None:
        """Facts a run's lines told (companion records, environment reports), with its events."""
        row = self.store.conn.execute("SELECT facts FROM runs WHERE id = ?", (run_id,)).fetchone()
        current = json.loads(row[0]) if row and row[0] else {}
        self.store.update_run_facts(run_id, run_update(current, facts))

    # -- scan ------------------------------------------------------------------------------------

    def scan(self) -> list[Change]:
        """Read every file to its end once (unterminated last lines included)."""
        changes = self.step(final=True)
        self.stats.files = len(self.tracker.records)
        return changes

    def run_ids(self) -> list[int]:
        """The runs of every file these paths cover (read now or before)."""
        ids = {r.run_id for r in self.tracker.records.values() if r.run_id is not None}
        ids |= {r.run_id for r in self.tracker.retired if r.run_id is not None}
        return sorted(ids | self.stats.runs)

    def counters(self) -> dict[str, Any]:
        return {**self.tracker.counters, **self.monitor.counters, **self.detector.counters}
