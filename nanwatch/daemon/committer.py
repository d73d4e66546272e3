"""The commit: a batch's offsets, events and metrics in one transaction (invariants 1 and 2).

Records of followed files (``sources.SourceRecord``, mutable, owned by the tracker) move forward
only once the store has what was read before their new offset; a batch the database refuses is
kept whole and written again before anything else is read. Decisions about files that come with
no bytes (a new file, a rotated copy resuming at byte N, a rename, a retirement) are stored too,
so a restart makes the same decisions.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import field
from typing import Any

from .._dc import dataclass
from ..errors import StoreError
from ..events import Event, Metric, now_utc
from ..sources import Chunk, Root, SourceRecord, Tracker
from ..sources.discover import rank_from_path
from ..store import Store
from ..store.metrics import MetricColumns, Packed
from ..store.records import JSON, Source
from ..store.sources import Sources
from ..stream import StreamState
from .run_identity import RunIdentity


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


# rows from a detection worker are plain tuples in Metric's field order, or a packed block;
# a live pass's are the columns the detector read
MetricRows = list[Metric] | list[tuple[Any, ...]] | Packed | MetricColumns


@dataclass
class Pending:
    """What one chunk gave, waiting for its commit."""

    chunk: Chunk
    events: list[Event]
    metrics: MetricRows
    state: StreamState
    size: int = 0  # bytes read (the chunk may no longer hold them)
    lines: int = 0
    facts: list[dict[str, JSON]] = field(default_factory=list)  # run facts the lines told


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


def _widen(
    spans: dict[int, tuple[str, str]], run_id: int, times: list[str | None], metrics: MetricRows
) -> None:
    """Stretch ``spans[run_id]`` (first, last time) over event times and metric rows' times."""
    known = [t for t in times if t]
    if isinstance(metrics, Packed):
        known.extend(t for t in metrics.times if t)
    elif isinstance(metrics, MetricColumns):
        known.extend(t for t in metrics.time if t)
    else:
        known.extend(m[6] for m in metrics if m[6])
    if not known:
        return
    lo, hi = min(known), max(known)
    was = spans.get(run_id)
    spans[run_id] = (lo, hi) if was is None else (min(was[0], lo), max(was[1], hi))


def stored(
    rec: SourceRecord, chunk: Chunk | None = None, state: StreamState | None = None
) -> Source:
    """The store's row for a record: at a chunk's end (with the state after it), else as the
    record is in memory."""
    if chunk is None:
        offset, tail, head, head_len, cutting = (
            rec.offset,
            rec.tail_hash,
            rec.head_hash,
            rec.head_len,
            rec.cutting,
        )
    else:
        offset, tail, head, head_len, cutting = (
            chunk.end,
            chunk.tail_hash,
            chunk.head_hash,
            chunk.head_len,
            chunk.cutting,
        )
    return Source(
        id=rec.id,
        run_id=rec.run_id,
        path=rec.path,
        root=rec.root.spec,
        dev=rec.dev,
        ino=rec.ino,
        gen=rec.gen,
        offset=offset,
        head_hash=head,
        head_len=head_len,
        tail_hash=tail,
        cutting=cutting,
        lines_cut=rec.lines_cut,
        status=rec.status,
        ctx=(state or rec.state).to_json(),
    )


def known_records(sources: Sources, roots: list[Root]) -> list[SourceRecord]:
    """Records from earlier runs of nanwatch for files under these roots."""
    out = []
    for src in sources.load():
        root = next((r for r in roots if r.contains(src.path)), None)
        if root is None:
            continue
        rec = SourceRecord(
            path=src.path,
            root=root,
            dev=src.dev,
            ino=src.ino,
            run_id=src.run_id,
            id=src.id,
            gen=src.gen,
            offset=src.offset,
            head_hash=src.head_hash,
            head_len=src.head_len,
            tail_hash=src.tail_hash,
            status=src.status,
            cutting=src.cutting,
            lines_cut=src.lines_cut,
        )
        rec.state = StreamState.from_json(src.ctx)
        if rec.state.rank is None:
            rec.state.rank = rank_from_path(rec.path, root.base)
        out.append(rec)
    return out


class Committer:
    """Writes batches and file decisions to the store; moves the records once committed."""

    def __init__(self, store: Store, sources: Sources, identity: RunIdentity, stats: Stats) -> None:
        self.store = store
        self.sources = sources
        self.identity = identity
        self.stats = stats
        # when events count as read (their ingested_at); a replay passes its simulated clock
        self.now_utc: Callable[[], str] = now_utc
        # called on the writer thread after every commit: a long catch-up still shows progress
        self.on_progress: Callable[[], None] | None = None
        # a batch read and detected whose commit the database refused (disk full): the next
        # pass writes it before reading anything, so a retry costs a commit, not a re-read
        self.unsaved: list[Pending] = []

    def retry_unsaved(self) -> None:
        """Write the batch the database refused last time (refused again: kept again)."""
        if self.unsaved:
            unsaved, self.unsaved = self.unsaved, []
            self.commit(unsaved)

    def commit(self, batch: list[Pending]) -> None:
        if not batch:
            return
        try:
            with _ids_undone([p.chunk.record for p in batch]):
                self.write(batch)
        except StoreError:
            self.unsaved = batch
            raise

    def write(self, batch: list[Pending]) -> None:
        """One transaction: offsets, stream states, events, metrics, run facts and spans."""
        ingested = self.now_utc()
        counted: Counter[str] = Counter()
        metrics = 0
        spans: dict[int, tuple[str, str]] = {}
        with self.store.transaction():
            # what launchers printed first: a rank's events read in the same batch as the
            # launcher's log get their local ranks from it
            for p in batch:
                rec = p.chunk.record
                if rec.run_id is None:
                    continue
                self.identity.touched([rec.run_id])
                if p.state.launch and p.state.launch != rec.state.launch:
                    self.identity.launch_printed(rec.run_id, p.state.launch)
            for p in batch:
                rec = p.chunk.record
                if p.chunk.final:
                    if rec.id is None:
                        rec.id = self.sources.save(stored(rec))
                else:
                    rec.id = self.sources.save(stored(rec, p.chunk, p.state))
                if p.facts and rec.run_id is not None:
                    self.identity.record_facts(rec.run_id, p.facts)
                events = self.identity.identify(rec.run_id, p.events, p.state)
                n = self.store.insert_events(rec.run_id, rec.id, events, ingested)
                metrics += self._write_metrics(rec, p.metrics)
                if n:
                    counted.update(e.kind for e in p.events)
                if rec.run_id is not None:
                    # a run's start and end as its logs tell them (`runs`, datasette)
                    _widen(spans, rec.run_id, [e.time for e in events], p.metrics)
            # one update per run, not per chunk (a live pass has a chunk per rank log)
            for run_id, (lo, hi) in spans.items():
                self.store.widen_run_span(run_id, [lo, hi])
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
                Tracker.committed(p.chunk)
                p.chunk.record.state = p.state
        self.stats.commits += 1
        self.stats.last_commit = time.time()
        if self.on_progress is not None:
            self.on_progress()

    def _write_metrics(self, rec: SourceRecord, rows: MetricRows) -> int:
        """The one place metrics are written (in the batch's transaction)."""
        if isinstance(rows, MetricColumns):
            return self.store.insert_metric_columns(rec.run_id, rec.id, rows)
        return self.store.insert_metrics(rec.run_id, rec.id, rows)

    # -- decisions about files -------------------------------------------------------------------

    def retired(self, rec: SourceRecord) -> None:
        """A record the tracker just retired: its status goes to the store now."""
        if rec.id is not None:
            self.sources.set_status(rec.id, rec.status)
            rec.saved_status = rec.status

    def persist(self, tracker: Tracker) -> None:
        """Every decision about a file (a new one, a rotated copy resuming at byte N, a new
        generation after truncation, a retirement) is stored even when no bytes came with it,
        so a restart makes the same decision."""
        # (a file still empty under a rotated name waits: it may be a copy being written)
        active = [
            rec
            for rec in tracker.records.values()
            if rec.status == "active"
            and not rec.unjudged
            and (rec.id is None or rec.renamed or rec.resumed)
        ]
        retired = [
            rec for rec in tracker.retired if rec.id is not None and rec.saved_status != rec.status
        ]
        if not active and not retired:
            return  # nothing to write: no transaction either (the idle daemon's usual pass)
        with _ids_undone(active), self.store.transaction():
            for rec in active:
                if rec.id is not None and rec.renamed:
                    self.sources.rename(rec.id, rec.path)
                    rec.renamed = False
                if rec.id is None or rec.resumed:
                    rec.id = self.sources.save(stored(rec))
                    rec.resumed = False
            for rec in retired:
                assert rec.id is not None
                self.sources.set_status(rec.id, rec.status)
                rec.saved_status = rec.status
