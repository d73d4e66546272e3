"""One pass over the sources: read what is new, detect, commit it with its offsets, correlate.

`scan` is one pass to the end of every file; `watch` (``pipeline``) repeats passes as files
change. The caller's thread owns the write connection. A pass is composed of parts that each
do one thing: the tracker (``sources``) follows files, the router sends each to its reader, the
run identity names runs and ranks, the committer writes a batch in one transaction, the
correlator turns what was committed into incident changes for the outbox.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..correlate import Change, Correlator
from ..correlate.chains import Timeouts
from ..detect.msprobe.reader import MonitorReader
from ..detect.rules import RuleSet, load_rules
from ..sources import Chunk, Root, SourceRecord, Tracker, make_roots
from ..store import Store
from ..store.sources import Sources
from ..stream import StreamState
from .committer import Committer, Pending, Stats, known_records
from .router import Route, Router
from .run_identity import RunIdentity

# what only some passes need loads when first needed: the worker pool (a scan of more than
# POOL_MIN_BYTES), the outbox (a configured sink), the knowledge base (a first incident's
# hints), checkpoint shapes (a first msprobe finding to explain), the detection engine (a first
# text file)
if TYPE_CHECKING:
    from ..correlate.knowledge import Knowledge
    from ..correlate.shapes import ShapeResolver
    from ..detect.engine import Detector
    from ..detect.pool import DetectorPool, Done
    from ..notify.outbox import Outbox, Sink

BATCH_BYTES = 16 << 20  # commit at least this often during a catch-up
BATCH_EVENTS = 50_000
POOL_MIN_BYTES = 32 << 20  # a scan reads more text than this: detect in worker processes
# watch: a pass that committed nothing correlates at most this often (quiet incidents still
# resolve on time), and step times are looked at for slowdowns at most every SLOWDOWN_GAP s
# and with at most SLOWDOWN_SHARE of the time (a long run's history is reread each time)
QUIET_CORRELATE = 60.0
SLOWDOWN_GAP = 5.0
SLOWDOWN_SHARE = 0.02


def _knowledge(config: Config) -> Knowledge | Callable[[], Knowledge]:
    """The knowledge base, or how to load it when a first incident needs hints: site folders
    are read now, so that a bad one fails at start and names its file."""

    def load() -> Knowledge:
        from ..correlate.knowledge import Knowledge

        return Knowledge.load(config.knowledge.dirs, cann_version=config.knowledge.cann_version)

    return load() if config.knowledge.dirs else load


def _detector(rules: RuleSet) -> Detector:
    from ..detect.engine import Detector

    return Detector(rules)


def _shape_lookup(config: Config) -> Callable[[str | None, str, list[int] | None], Any]:
    """Checkpoint shape look-ups for msprobe findings; the readers load on the first one."""
    resolver: list[ShapeResolver] = []

    def lookup(folder: str | None, tensor: str, shape: list[int] | None) -> Any:
        if not resolver:
            from ..correlate.shapes import ShapeResolver

            resolver.append(ShapeResolver(config.shapes.checkpoint))
        return resolver[0].lookup(folder, tensor, shape)

    return lookup


def _outbox(store: Store, sinks: list[Sink]) -> Outbox | None:
    if not sinks:
        return None
    from ..notify.outbox import Outbox

    return Outbox(store, sinks)


class _Batch:
    """Pending chunks of one pass, committed together once they are big enough."""

    def __init__(self, commit: Callable[[list[Pending]], None]) -> None:
        self.commit = commit
        self.items: list[Pending] = []
        self.size = 0
        self.events = 0
        self.last: dict[int, StreamState] = {}  # each record's state after its last chunk

    def add(self, p: Pending) -> None:
        self.items.append(p)
        self.last[id(p.chunk.record)] = p.state
        self.size += p.size
        self.events += len(p.events)
        if self.size >= BATCH_BYTES or self.events >= BATCH_EVENTS:
            self.flush()

    def flush(self) -> None:
        items, self.items, self.size, self.events = self.items, [], 0, 0
        self.commit(items)


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


class _Schedule:
    """When a live pass runs the correlator (and its slowdown check); a scan always does."""

    def __init__(self, correlator: Correlator, live: bool) -> None:
        self.correlator = correlator
        self.live = live
        self._correlated = float("-inf")  # when the correlator last ran (monotonic)
        self._next_slowdowns = 0.0

    def correlate(self, committed: bool) -> list[Change]:
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


class Passes:
    """Reads the given paths into the store, one pass at a time. ``live`` means the files keep
    growing (`watch`). Built here from its parts; nothing below knows about the others."""

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
        self.roots = make_roots(list(paths), must_exist=not live)
        self.rules = rules if rules is not None else load_rules(config.detect.rule_dirs)
        rs = self.rules
        self.router = Router(lambda: _detector(rs), MonitorReader(_shape_lookup(config)))
        self.stats = Stats()
        self.identity = RunIdentity(store, config.cluster, forced_run=run or config.cluster.run)
        self.sources = Sources(store)
        self.committer = Committer(store, self.sources, self.identity, self.stats)
        self.tracker = Tracker(
            self.roots,
            self.identity.assign,
            known=known_records(self.sources, self.roots),
            next_gen=self.sources.next_gen,
            live=live,
        )
        for rec in [*self.tracker.records.values(), *self.tracker.retired]:
            self.router.monitor.restore(rec.path, rec.state)
        self.correlator = Correlator(
            store,
            timeouts=Timeouts(config.knowledge.hccl_exec_timeout, config.knowledge.nccl_timeout),
            knowledge=_knowledge(config),
            resolve_after=config.alerts.resolve_after if live else None,
        )
        self.schedule = _Schedule(self.correlator, live)
        self.sinks = list(sinks)
        self.outbox = _outbox(store, self.sinks)
        self.on_changes = on_changes
        self.wake = threading.Event()  # set when the next pass has work already known
        self.stop_by: float | None = None  # monotonic time after which reading stops

    @property
    def detector(self) -> Detector:
        return self.router.detector

    # -- one pass --------------------------------------------------------------------------------

    def step(
        self, *, final: bool = False, discover: bool = True, only: Iterable[str] | None = None
    ) -> list[Change]:
        """Read what is new, commit it with its offsets, correlate; return incident changes."""
        self.committer.retry_unsaved()  # refused again: kept again, and nothing else is read
        if discover:
            self.tracker.discover()
        if only is not None:
            only = self.tracker.touched(only)
        settled = self.tracker.settle_pending()
        wanted = set(only) | {r.path for r in settled} if only is not None else None
        commits = self.stats.commits
        batch = _Batch(self.committer.commit)
        records = [
            rec
            for rec in sorted(self.tracker.records.values(), key=self.router.read_order)
            if wanted is None or rec.path in wanted
        ]
        pooled = self._pooled(records, final)
        try:
            for rec in records:
                route = self.router.route(rec)
                if route == "snapshot":
                    pending = self._snapshot(rec)
                    if pending is not None:
                        batch.add(pending)
                elif route == "rules" and pooled is not None:
                    self._take_pooled(rec, pooled, batch)
                else:
                    self._read(rec, route, final, batch)
        finally:
            if pooled is not None:
                pooled.close()
        if final:
            for rec in records:
                self._ended(rec, batch)
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
            self.tracker.retire_vanished(rec)
            self.committer.retired(rec)
        self.committer.persist(self.tracker)
        self.identity.refresh()
        changes = self.schedule.correlate(self.stats.commits != commits)
        if changes:
            if self.outbox is not None:
                self.outbox.enqueue(changes, immediate=not self.live)
            if self.on_changes is not None:
                self.on_changes(changes)
        return changes

    def _ended(self, rec: SourceRecord, batch: _Batch) -> None:
        """A scan read ``rec`` to its end: what the end of its text says (a traceback cut off
        there), committed like an unterminated last line (no offset or state moves)."""
        if rec.fd is None or self.router.route(rec) != "rules":
            return
        state = batch.last.get(id(rec), rec.state)
        if not state.records:
            return
        events = self.detector.ended(state, rec.path)
        if not events:
            return
        if rec.run_id is None:
            rec.run_id = self.identity.assign(rec.root, rec.path)
        end = Chunk(rec, b"", rec.offset, rec.offset, None, None, 0, False, final=True)
        batch.add(Pending(end, events, [], state))

    def _read(self, rec: SourceRecord, route: Route, final: bool, batch: _Batch) -> None:
        """Read a record's new chunks and detect in this process."""
        states: dict[int, StreamState] = {}
        for chunk in self.tracker.read(rec, final=final):
            if self.stop_by is not None and time.monotonic() > self.stop_by:
                break  # stopping: what was read is committed, the rest waits for the next start
            if chunk.final and route != "rules":
                continue  # an unterminated CSV row may be half-written: never parsed
            r = chunk.record
            if r.run_id is None:
                r.run_id = self.identity.assign(r.root, r.path)
            st = states.get(id(r))
            if st is None:
                st = copy.copy(r.state)
            work = copy.copy(st) if chunk.final else st
            events, metrics, facts = self.router.feed(route, chunk, work)
            if not chunk.final:
                states[id(r)] = st
            size, lines = len(chunk.data), chunk.data.count(b"\n")
            # the batch keeps what the commit needs, not the bytes (memory stays flat)
            light = copy.copy(chunk)
            light.data = b""
            batch.add(Pending(light, events, metrics, work, size, lines, facts))

    def _pooled(self, records: list[SourceRecord], final: bool) -> _Pooled | None:
        """Worker processes for the rule packs, when a scan has enough text to read."""
        if self.live or not final:
            return None
        texts = [r for r in records if self.router.route(r) == "rules"]
        todo = [n for r in texts if r.status == "active" and (n := _size(r.path) - r.offset) > 0]
        if len(todo) < 2 or sum(todo) < POOL_MIN_BYTES:
            return None
        from ..detect import pool as detect_pool

        workers = min(detect_pool.usable_workers(), len(todo))
        if workers < 2:
            return None
        from ..store.metrics import pack

        # the workers pack each chunk's metrics into the block the writer stores
        pool = detect_pool.DetectorPool(self.detector, workers, pack=pack)
        return _Pooled(pool, pool.ordered(self.tracker.read(r, final=final) for r in texts), texts)

    def _take_pooled(self, rec: SourceRecord, pooled: _Pooled, batch: _Batch) -> None:
        """The results of one text record, detected in a worker, in their serial order."""
        index = pooled.index[id(rec)]
        msprobe: dict[int, dict[str, object] | None] = {}
        while True:
            got = pooled.peek()
            if got is None or got[0] != index:
                return
            pooled.next()
            chunk, size, lines, events, metrics, state, facts = got[1]
            r = chunk.record
            if r.run_id is None:
                r.run_id = self.identity.assign(r.root, r.path)
            # msprobe alert-line counts live in the state but are kept here, not in the worker
            state.msprobe = msprobe.get(id(r), r.state.msprobe)
            events = self.router.bound(events, state, r.path)
            if not chunk.final:
                msprobe[id(r)] = state.msprobe
            batch.add(Pending(chunk, events, metrics, state, size, lines, facts))

    def _snapshot(self, rec: SourceRecord) -> Pending | None:
        """A file rewritten in place (msprobe's anomaly.json): read whole when it changed."""
        from ..detect.msprobe.dump import Rewritten

        if rec.status != "active":
            return None
        state = copy.copy(rec.state)
        try:
            got = self.router.snapshot(rec, state)
        except Rewritten:
            rec = self.tracker.restart_generation(rec, "rewritten from scratch")
            state = copy.copy(rec.state)
            got = self.router.snapshot(rec, state, force=True)
        if got is None:
            return None
        events, size = got
        if rec.run_id is None:
            rec.run_id = self.identity.assign(rec.root, rec.path)
        # offset = the size read; no tail checksum: the bytes before it are rewritten each time
        return Pending(Chunk(rec, b"", 0, size, None, None, 0, False), events, [], state)

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

    def counters(self) -> dict[str, int]:
        detector = self.router.detector_counters()
        return {**self.tracker.counters, **self.router.monitor.counters, **detector}

    # -- reload ----------------------------------------------------------------------------------

    def reconfigure(
        self,
        config: Config,
        roots: list[Root],
        *,
        rules: RuleSet | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        """Swap config, sources, rules and sinks between passes, keeping every offset.

        Files still covered by a source keep their records (offsets, stream context, run);
        files no longer covered are closed but stay active in the store, so adding them back
        resumes where they stopped; files of new sources resume from their stored offsets.
        """
        self.config = config
        self.identity.reconfigure(config.cluster, forced_run=self._run_arg or config.cluster.run)
        self.identity.touched(self.run_ids())  # [cluster] may name them differently now
        if self.live:
            self.correlator.resolve_after = config.alerts.resolve_after
        if rules is not None:
            self.rules = rules
            counters = self.router.detector_counters()
            self.router.detector = _detector(rules)
            self.router.detector.counters.update(counters)  # counters count since start
        if sinks is not None:
            self.sinks = list(sinks)
            self.outbox = _outbox(self.store, self.sinks)
        # Tracker and Watcher hold this very list: change it in place.
        self.roots[:] = roots
        tracker = self.tracker
        for rec in list(tracker.records.values()):
            root = self._root_of(rec.path, rec.root)
            if root is None:
                tracker.close_fd(rec)
                del tracker.records[rec.key]
            else:
                rec.root = root
        kept = []
        for rec in tracker.retired:
            root = self._root_of(rec.path, rec.root)
            if root is not None:
                rec.root = root
                kept.append(rec)
        tracker.retired = kept
        known_ids = {r.id for r in tracker.records.values()} | {r.id for r in kept}
        for rec in known_records(self.sources, self.roots):
            if rec.id in known_ids:
                continue
            if rec.status == "active":
                tracker.records.setdefault(rec.key, rec)
            else:
                tracker.retired.append(rec)

    def _root_of(self, path: str, current: Root) -> Root | None:
        if current in self.roots:
            return current
        return next((r for r in self.roots if r.contains(path)), None)
