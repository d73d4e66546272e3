"""The outbox: incident changes queued in SQLite, delivered by a sender thread with retries.

Detection never waits for a sink (invariant 6). The sender reads due rows through its own
read-only connection and reports results on a queue; the writer thread records them, so the
store keeps a single writer (invariant 5).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..correlate import Change
from ..errors import DeliveryError
from ..events import now_utc
from ..store.db import Store

log = logging.getLogger("nanwatch.notify")

MAX_BACKOFF = 600.0


class Sink(Protocol):
    """A place incidents are told to. ``deliver`` raises DeliveryError to be retried."""

    name: str

    def delay(self, action: str) -> float:
        """Seconds to hold a change before it is due (e.g. group_wait for a new incident)."""

    def deliver(
        self, row: Mapping[str, Any], incident: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """Deliver one outbox row; return what should be remembered (e.g. a message ts)."""


@dataclass(frozen=True)
class Result:
    row_id: int
    ok: bool
    error: str | None = None
    retry_at: float | None = None
    permanent: bool = False
    remember: Mapping[str, Any] | None = None


class Outbox:
    """Writer-side API: enqueue changes, record delivery results."""

    def __init__(self, store: Store, sinks: Sequence[Sink]) -> None:
        self.store = store
        self.sinks = list(sinks)

    def enqueue(self, changes: Iterable[Change], *, immediate: bool = False) -> int:
        now = time.time()
        n = 0
        rows = []
        for ch in changes:
            for sink in self.sinks:
                delay = 0.0 if immediate else sink.delay(ch.action)
                rows.append(
                    (
                        ch.incident_id,
                        sink.name,
                        ch.action,
                        json.dumps({"version": ch.version, "news": ch.news}),
                        f"{sink.name}:{ch.incident_id}:{ch.action}:{ch.version}",
                        now_utc(),
                        now + delay,
                    )
                )
        if rows:
            before = self.store.conn.total_changes
            with self.store.transaction():
                self.store.conn.executemany(
                    "INSERT OR IGNORE INTO outbox(incident_id, sink, action, payload, dedup_key, "
                    "created_at, due_at) VALUES (?,?,?,?,?,?,?)",
                    rows,
                )
            n = self.store.conn.total_changes - before
        return n

    def record(self, results: Iterable[Result]) -> None:
        results = list(results)
        if not results:
            return
        with self.store.transaction():
            for r in results:
                if r.ok:
                    self.store.execute(
                        "UPDATE outbox SET delivered_at=?, attempts=attempts+1, last_error=NULL "
                        "WHERE id=?",
                        (now_utc(), r.row_id),
                    )
                elif r.permanent:
                    self.store.execute(
                        "UPDATE outbox SET delivered_at=?, attempts=attempts+1, last_error=? "
                        "WHERE id=?",
                        ("failed " + now_utc(), r.error, r.row_id),
                    )
                else:
                    self.store.execute(
                        "UPDATE outbox SET attempts=attempts+1, last_error=?, due_at=? WHERE id=?",
                        (r.error, r.retry_at or time.time() + 5, r.row_id),
                    )

    def pending(self) -> int:
        row = self.store.conn.execute(
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL"
        ).fetchone()
        return int(row[0])


def load_incident(conn: Any, incident_id: int) -> dict[str, Any] | None:
    from ..query import incident_dict

    return incident_dict(conn, incident_id)


class Sender:
    """Delivers due outbox rows on its own thread; results go back through ``results``."""

    def __init__(self, db_path: str, sinks: Sequence[Sink], *, interval: float = 0.5) -> None:
        self.db_path = db_path
        self.sinks = {s.name: s for s in sinks}
        self.interval = interval
        self.results: queue.Queue[Result] = queue.Queue()
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

    def drain_results(self) -> list[Result]:
        out: list[Result] = []
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

    def deliver_due(self, store: Store, *, now: float | None = None) -> int:
        """Deliver every due row not already in flight; return how many were attempted."""
        now = time.time() if now is None else now
        rows = store.conn.execute(
            "SELECT id, incident_id, sink, action, payload, attempts FROM outbox "
            "WHERE delivered_at IS NULL AND due_at <= ? ORDER BY due_at, id LIMIT 200",
            (now,),
        ).fetchall()
        n = 0
        for rid, iid, sink_name, action, payload, attempts in rows:
            if rid in self._inflight or rid in self._done or self._stop.is_set():
                continue
            if self._not_before.get(rid, 0.0) > now:
                continue
            sink = self.sinks.get(sink_name)
            if sink is None:
                continue
            self._inflight.add(rid)
            n += 1
            row = {
                "id": rid,
                "incident_id": iid,
                "sink": sink_name,
                "action": action,
                "payload": json.loads(payload or "{}"),
                "attempts": attempts,
            }
            incident = load_incident(store.conn, iid) if iid is not None else {}
            try:
                remember = sink.deliver(row, incident or {})
                self._done.add(rid)
                self._inflight.discard(rid)
                self.results.put(Result(rid, True, remember=remember))
            except DeliveryError as e:
                tries = attempts + 1
                backoff = min(MAX_BACKOFF, 2.0 ** min(tries, 10))
                retry_at = time.time() + max(backoff, e.retry_after or 0.0)
                log.warning(
                    "%s: delivery of incident %s failed (%s); retry in %.0fs",
                    sink_name,
                    iid,
                    e,
                    retry_at - time.time(),
                )
                if e.permanent:
                    self._done.add(rid)
                else:
                    self._not_before[rid] = retry_at
                self._inflight.discard(rid)
                self.results.put(Result(rid, False, str(e), retry_at, e.permanent))
        return n
