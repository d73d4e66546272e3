"""The outbox: incident changes queued in SQLite, delivered by a sender thread with retries.

Detection never waits for a sink (invariant 6). The sender reads due rows through its own
read-only connection and reports results on a queue; the writer thread records them, so the
store keeps a single writer (invariant 5).

A sink may opt in to more than "one row, one delivery":

- ``coalesce = True``: every undelivered row of the same incident that was queued before the
  due one is handed over with it (``absorbed``) and marked delivered together, so a
  sink that renders the incident's current state sends one message for many changes
  (actions named in ``solo_actions`` are never merged).
- ``load(db, incident_id)``: reads what the sink needs about an incident (through an
  :class:`OutboxStore` on the sender's read-only connection) instead of :func:`load_incident`.
- ``repeat_interval`` (seconds, > 0): open incidents this sink has told about and not
  mentioned since are queued again as ``remind`` rows.
- raising :class:`Deferred` holds a row until a given time without counting an attempt
  (an active silence, a rate limit that was never hit, a parent message not posted yet).
- ``max_attempts`` (action -> count): rows of a best-effort action (Slack's plot) are given
  up after that many failed attempts instead of being retried for ever.

What a sink returns from ``deliver`` (:class:`Posted`: the message it posted, its channel and
``ts``) is kept in the ``messages`` table, so the next process edits the same message instead of
posting anew; ``Posted(then=("plot",))`` queues follow-up rows (once per incident and action),
delivered and retried like any other. The sender turns what happened into an :class:`Outcome`
(delivered, retry at, held until, given up) and the writer has the store record it.

Every time here comes from an injected ``clock`` (epoch seconds), so tests move it instead of
waiting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from .._dc import dataclass
from ..correlate import Change
from ..errors import DeliveryError, NanwatchError
from ..events import format_utc
from ..store.db import Store
from ..store.outbox import SILENCED, OutboxStore
from ..store.records import JSON, MessageRef, OutboxRow, Outcome, Queued
from .view import load_incident

__all__ = [
    "MAX_BACKOFF",
    "SILENCED",
    "Deferred",
    "Outbox",
    "Posted",
    "Result",
    "Sender",
    "Sink",
    "load_incident",
]

log = logging.getLogger("nanwatch.notify")

MAX_BACKOFF = 600.0

Clock = Callable[[], float]
Result = Outcome  # what the sender reports for one row (the name the pipeline knows)


@dataclass(frozen=True, slots=True)
class Posted:
    """What a sink did that must outlive the process: the message it posted or edited (kept
    in ``messages``) and the follow-up actions to queue for the incident."""

    message: MessageRef | None = None
    then: tuple[str, ...] = ()


class Sink(Protocol):
    """A place incidents are told to. ``deliver`` raises DeliveryError to be retried."""

    name: str

    def delay(self, action: str) -> float:
        """Seconds to hold a change before it is due (e.g. group_wait for a new incident)."""

    def deliver(
        self,
        row: OutboxRow,
        incident: Mapping[str, JSON],
        absorbed: Sequence[OutboxRow] = (),
    ) -> Posted | None:
        """Deliver one outbox row (and the ``absorbed`` ones merged into it)."""


class Deferred(NanwatchError):
    """Hold a row until ``until`` (epoch seconds); not a failed attempt."""

    def __init__(self, reason: str, until: float) -> None:
        super().__init__(reason)
        self.until = until


class Outbox:
    """Writer-side API: enqueue changes, record delivery results, queue reminders."""

    def __init__(self, store: Store, sinks: Sequence[Sink], *, clock: Clock = time.time) -> None:
        self.store = store
        self.db = OutboxStore(store)
        self.sinks = list(sinks)
        self.clock = clock

    def enqueue(self, changes: Iterable[Change], *, immediate: bool = False) -> int:
        now = self.clock()
        rows = [
            Queued(
                ch.incident_id,
                sink.name,
                ch.action,
                {"version": ch.version, "news": ch.news, "immediate": immediate},
                f"{sink.name}:{ch.incident_id}:{ch.action}:{ch.version}",
                now + (0.0 if immediate else sink.delay(ch.action)),
            )
            for ch in changes
            for sink in self.sinks
        ]
        return self.db.enqueue(rows, created_at=format_utc(now))

    def enqueue_reminders(self, *, now: float | None = None) -> int:
        """Queue a ``remind`` row for open incidents not mentioned for ``repeat_interval``."""
        now = self.clock() if now is None else now
        n = 0
        for sink in self.sinks:
            every = float(getattr(sink, "repeat_interval", 0) or 0)
            if every <= 0:
                continue
            quiet = self.db.quiet_messages(sink.name, format_utc(now - every))
            rows = [
                Queued(
                    m.incident_id,
                    sink.name,
                    "remind",
                    {},
                    f"{sink.name}:{m.incident_id}:remind:{m.updated_at or m.posted_at}",
                    now,
                )
                for m in quiet
            ]
            n += self.db.enqueue(rows, created_at=format_utc(now))
        return n

    def record(self, results: Iterable[Outcome]) -> None:
        """Have the store record what the sender decided."""
        now = self.clock()
        self.db.record(results, now=now, now_text=format_utc(now))

    def pending(self, *, include_silenced: bool = True) -> int:
        return self.db.pending(include_silenced=include_silenced)

    def waiting(self) -> tuple[int, float | None]:
        """Undelivered rows not held by a silence, and when the first of them is due."""
        return self.db.unsent()

    def due(self, now: float) -> int:
        """Undelivered rows due by ``now`` (silenced ones included)."""
        return self.db.due_count(now)


class Sender:
    """Delivers due outbox rows on its own thread; results go back through ``results``.

    ``notify`` is called after results were queued, so the writer can record them promptly
    (a posted message's ts should reach the store before anything else can go wrong).
    """

    def __init__(
        self,
        db_path: str,
        sinks: Sequence[Sink],
        *,
        interval: float = 0.5,
        notify: Callable[[], None] | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.db_path = db_path
        self.sinks = {s.name: s for s in sinks}
        self.interval = interval
        self.notify = notify
        self.clock = clock
        self.results: queue.Queue[Outcome] = queue.Queue()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Rows this sender finished or must not retry yet, whatever the store says until the
        # writer has recorded the result (it may read a row again before that happens).
        self._inflight: set[int] = set()
        self._done: set[int] = set()
        self._not_before: dict[int, float] = {}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nanwatch-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain_results(self) -> list[Outcome]:
        out: list[Outcome] = []
        while True:
            try:
                r = self.results.get_nowait()
            except queue.Empty:
                return out
            out.append(r)

    def _run(self) -> None:
        store = Store.open(self.db_path, readonly=True)
        try:
            while not self._stop.is_set():
                try:
                    self.deliver_due(store)
                except Exception:  # a sink bug must not kill delivery for good
                    log.exception("delivery pass failed; retrying")
                self.wake.wait(self.interval)
                self.wake.clear()
        finally:
            store.close()

    def _put(self, result: Outcome) -> None:
        self.results.put(result)
        if self.notify is not None:
            self.notify()

    def deliver_due(self, store: Store, *, now: float | None = None) -> int:
        """Deliver every due row not already in flight; return how many were attempted."""
        now = self.clock() if now is None else now
        db = OutboxStore(store)
        n = 0
        for row in db.due(now):
            rid, iid = row.id, row.incident_id
            if rid in self._inflight or rid in self._done or self._stop.is_set():
                continue
            if self._not_before.get(rid, 0.0) > now:
                continue
            sink = self.sinks.get(row.sink)
            if sink is None:
                continue
            self._inflight.add(rid)
            n += 1
            absorbed: list[OutboxRow] = []
            solo = tuple(getattr(sink, "solo_actions", ()))
            if getattr(sink, "coalesce", False) and iid is not None and row.action not in solo:
                absorbed = [s for s in self._siblings(db, row) if s.action not in solo]
            # the incident is read after its rows, so it is at least as new as any of them
            loader = getattr(sink, "load", None) or load_incident
            incident = loader(db, iid) if iid is not None else {}
            self._deliver_one(db, sink, row, absorbed, incident or {}, now)
        return n

    def _siblings(self, db: OutboxStore, row: OutboxRow) -> list[OutboxRow]:
        assert row.incident_id is not None
        return [
            s
            for s in db.undelivered(row.incident_id, row.sink, besides=row.id)
            if s.id not in self._done and s.id not in self._inflight
        ]

    def _deliver_one(
        self,
        db: OutboxStore,
        sink: Sink,
        row: OutboxRow,
        absorbed: Sequence[OutboxRow],
        incident: Mapping[str, JSON],
        now: float,
    ) -> None:
        rid, iid = row.id, row.incident_id
        try:
            silence = (
                db.silence_for(incident.get("run"), incident.get("kind"), now=now)
                if incident
                else None
            )
            if silence is not None:
                raise Deferred(
                    f"{SILENCED} until {format_utc(silence.until)} (silence {silence.id})",
                    silence.until,
                )
            posted = sink.deliver(row, incident, absorbed)
        except Deferred as d:
            self._not_before[rid] = d.until
            self._inflight.discard(rid)
            log.info("%s: incident %s held: %s", sink.name, iid, d)
            self._put(Outcome(rid, False, str(d), d.until, deferred=True))
            return
        except DeliveryError as e:
            self._failed(sink, row, e)
            return
        self._done.add(rid)
        self._done.update(a.id for a in absorbed)
        self._inflight.discard(rid)
        for a in absorbed:
            self.results.put(Outcome(a.id, True))
        if posted is None:
            self._put(Outcome(rid, True))
        else:
            self._put(Outcome(rid, True, message=posted.message, then=posted.then))

    def _failed(self, sink: Sink, row: OutboxRow, e: DeliveryError) -> None:
        """A failed attempt: retried with backoff (or when the service said), or given up."""
        rid = row.id
        tries = row.attempts + 1
        error, permanent = str(e), e.permanent
        limit = getattr(sink, "max_attempts", {}).get(row.action)
        if limit is not None and tries >= limit and not permanent:
            error, permanent = f"{error} (attempt {tries} of {limit}: given up)", True
        # from the clock, not the pass's `now`: the attempt may have taken a while
        failed_at = self.clock()
        if e.retry_after is not None:
            # the service said when (HTTP 429 Retry-After, or a fix that needs a person)
            retry_at = failed_at + max(e.retry_after, 1.0)
        else:
            retry_at = failed_at + min(MAX_BACKOFF, 2.0 ** min(tries, 10))
        log.warning(
            "%s: delivery of incident %s failed (%s); %s",
            sink.name,
            row.incident_id,
            error,
            "giving up" if permanent else f"retry in {retry_at - failed_at:.0f}s",
        )
        if permanent:
            self._done.add(rid)
        else:
            self._not_before[rid] = retry_at
        self._inflight.discard(rid)
        self._put(Outcome(rid, False, error, retry_at, permanent))
