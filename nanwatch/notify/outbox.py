"""The outbox: incident changes queued in SQLite, delivered by a sender thread with retries.

Detection never waits for a sink (invariant 6). The sender reads due rows through its own
read-only connection and reports results on a queue; the writer thread records them, so the
store keeps a single writer (invariant 5).

A sink may opt in to more than "one row, one delivery":

- ``coalesce = True``: every undelivered row of the same incident that was queued before the
  due one is handed over with it (``row["absorbed"]``) and marked delivered together, so a
  sink that renders the incident's current state sends one message for many changes
  (actions named in ``solo_actions`` are never merged).
- ``load(conn, incident_id)``: reads what the sink needs about an incident (on the sender's
  read-only connection) instead of :func:`load_incident`.
- ``repeat_interval`` (seconds, > 0): open incidents this sink has told about and not
  mentioned since are queued again as ``remind`` rows.
- raising :class:`Deferred` holds a row until a given time without counting an attempt
  (an active silence, a rate limit that was never hit, a parent message not posted yet).
- ``max_attempts`` (action -> count): rows of a best-effort action (Slack's plot) are given
  up after that many failed attempts instead of being retried for ever.

What a sink returns from ``deliver`` (``{"message": {"channel": ..., "ts": ...}}``) is kept in
the ``messages`` table, so the next process edits the same message instead of posting anew;
``{"then": ["plot"]}`` queues follow-up rows (once per incident and action), delivered and
retried like any other.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..correlate import Change
from ..errors import DeliveryError
from ..events import format_utc, now_utc
from ..store.db import Store
from .silences import active_silence

log = logging.getLogger("nanwatch.notify")

MAX_BACKOFF = 600.0
SILENCED = "silenced"  # prefix of last_error for rows held by a silence


class Sink(Protocol):
    """A place incidents are told to. ``deliver`` raises DeliveryError to be retried."""

    name: str

    def delay(self, action: str) -> float:
        """Seconds to hold a change before it is due (e.g. group_wait for a new incident)."""

    def deliver(
        self, row: Mapping[str, Any], incident: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        """Deliver one outbox row; return what should be remembered (e.g. a message ts)."""


class Deferred(Exception):
    """Hold a row until ``until`` (epoch seconds); not a failed attempt."""

    def __init__(self, reason: str, until: float) -> None:
        super().__init__(reason)
        self.until = until


@dataclass(frozen=True)
class Result:
    row_id: int
    ok: bool
    error: str | None = None
    retry_at: float | None = None
    permanent: bool = False
    remember: Mapping[str, Any] | None = None
    deferred: bool = False


class Outbox:
    """Writer-side API: enqueue changes, record delivery results, queue reminders."""

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
                        json.dumps(
                            {"version": ch.version, "news": ch.news, "immediate": immediate}
                        ),
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

    def enqueue_reminders(self, *, now: float | None = None) -> int:
        """Queue a ``remind`` row for open incidents not mentioned for ``repeat_interval``."""
        now = time.time() if now is None else now
        n = 0
        for sink in self.sinks:
            every = float(getattr(sink, "repeat_interval", 0) or 0)
            if every <= 0:
                continue
            stale = self.store.conn.execute(
                "SELECT m.incident_id, coalesce(m.updated_at, m.posted_at) FROM messages m "
                "JOIN incidents i ON i.id = m.incident_id "
                "WHERE m.sink = ? AND i.status = 'open' "
                "AND coalesce(m.updated_at, m.posted_at) < ? "
                "AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.incident_id = m.incident_id "
                "AND o.sink = m.sink AND o.delivered_at IS NULL)",
                (sink.name, format_utc(now - every)),
            ).fetchall()
            if not stale:
                continue
            before = self.store.conn.total_changes
            with self.store.transaction():
                self.store.conn.executemany(
                    "INSERT OR IGNORE INTO outbox(incident_id, sink, action, payload, dedup_key, "
                    "created_at, due_at) VALUES (?,?,'remind','{}',?,?,?)",
                    [
                        (iid, sink.name, f"{sink.name}:{iid}:remind:{last}", now_utc(), now)
                        for iid, last in stale
                    ],
                )
            n += self.store.conn.total_changes - before
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
                    if r.remember and "message" in r.remember:
                        self._remember(r.row_id, r.remember["message"])
                    if r.remember and r.remember.get("then"):
                        self._follow_up(r.row_id, r.remember["then"])
                elif r.deferred:
                    self.store.execute(
                        "UPDATE outbox SET last_error=?, due_at=? WHERE id=?",
                        (r.error, r.retry_at or time.time() + 5, r.row_id),
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

    def _remember(self, row_id: int, message: Mapping[str, Any]) -> None:
        row = self.store.conn.execute(
            "SELECT incident_id, sink FROM outbox WHERE id=?", (row_id,)
        ).fetchone()
        if row is None or row[0] is None:
            return
        now = now_utc()
        self.store.execute(
            "INSERT INTO messages(incident_id, sink, channel, ts, thread_ts, posted_at, "
            "updated_at) VALUES (?,?,?,?,?,?,?) ON CONFLICT(incident_id, sink) DO UPDATE SET "
            "channel=coalesce(excluded.channel, channel), ts=coalesce(excluded.ts, ts), "
            "thread_ts=coalesce(excluded.thread_ts, thread_ts), updated_at=excluded.updated_at",
            (
                row[0],
                row[1],
                message.get("channel"),
                message.get("ts"),
                message.get("thread_ts"),
                now,
                now,
            ),
        )

    def _follow_up(self, row_id: int, actions: Iterable[str]) -> None:
        row = self.store.conn.execute(
            "SELECT incident_id, sink FROM outbox WHERE id=?", (row_id,)
        ).fetchone()
        if row is None:
            return
        for action in actions:
            self.store.execute(
                "INSERT OR IGNORE INTO outbox(incident_id, sink, action, payload, dedup_key, "
                "created_at, due_at) VALUES (?,?,?,'{}',?,?,?)",
                (row[0], row[1], action, f"{row[1]}:{row[0]}:{action}", now_utc(), time.time()),
            )

    def pending(self, *, include_silenced: bool = True) -> int:
        sql = "SELECT count(*) FROM outbox WHERE delivered_at IS NULL"
        if not include_silenced:
            sql += f" AND coalesce(last_error, '') NOT LIKE '{SILENCED}%'"
        return int(self.store.conn.execute(sql).fetchone()[0])

    def waiting(self) -> tuple[int, float | None]:
        """Undelivered rows not held by a silence, and when the first of them is due."""
        row = self.store.conn.execute(
            "SELECT count(*), min(due_at) FROM outbox WHERE delivered_at IS NULL "
            f"AND coalesce(last_error, '') NOT LIKE '{SILENCED}%'"
        ).fetchone()
        return int(row[0]), row[1]

    def due(self, now: float) -> int:
        """Undelivered rows due by ``now`` (silenced ones included)."""
        row = self.store.conn.execute(
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL AND due_at <= ?", (now,)
        ).fetchone()
        return int(row[0])


def load_incident(conn: Any, incident_id: int) -> dict[str, Any] | None:
    from ..query import incident_dict

    return incident_dict(conn, incident_id)


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
    ) -> None:
        self.db_path = db_path
        self.sinks = {s.name: s for s in sinks}
        self.interval = interval
        self.notify = notify
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

    def _put(self, result: Result) -> None:
        self.results.put(result)
        if self.notify is not None:
            self.notify()

    def deliver_due(self, store: Store, *, now: float | None = None) -> int:
        """Deliver every due row not already in flight; return how many were attempted."""
        now = time.time() if now is None else now
        rows = store.conn.execute(
            "SELECT id, incident_id, sink, action, payload, attempts, due_at FROM outbox "
            "WHERE delivered_at IS NULL AND due_at <= ? ORDER BY due_at, id LIMIT 200",
            (now,),
        ).fetchall()
        n = 0
        for rid, iid, sink_name, action, payload, attempts, due_at in rows:
            if rid in self._inflight or rid in self._done or self._stop.is_set():
                continue
            if self._not_before.get(rid, 0.0) > now:
                continue
            sink = self.sinks.get(sink_name)
            if sink is None:
                continue
            self._inflight.add(rid)
            n += 1
            row: dict[str, Any] = {
                "id": rid,
                "incident_id": iid,
                "sink": sink_name,
                "action": action,
                "payload": json.loads(payload or "{}"),
                "attempts": attempts,
                "due_at": due_at,
                "absorbed": [],
            }
            solo = tuple(getattr(sink, "solo_actions", ()))
            if getattr(sink, "coalesce", False) and iid is not None and action not in solo:
                row["absorbed"] = [s for s in self._siblings(store, row) if s["action"] not in solo]
            # the incident is read after its rows, so it is at least as new as any of them
            loader = getattr(sink, "load", None) or load_incident
            incident = loader(store.conn, iid) if iid is not None else {}
            self._deliver_one(store, sink, row, incident or {})
        return n

    def _siblings(self, store: Store, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = []
        for sid, action, payload, due_at in store.conn.execute(
            "SELECT id, action, payload, due_at FROM outbox WHERE incident_id=? AND sink=? "
            "AND delivered_at IS NULL AND id != ? ORDER BY id",
            (row["incident_id"], row["sink"], row["id"]),
        ):
            if sid in self._done or sid in self._inflight:
                continue
            out.append(
                {
                    "id": sid,
                    "action": action,
                    "payload": json.loads(payload or "{}"),
                    "due_at": due_at,
                }
            )
        return out

    def _deliver_one(
        self, store: Store, sink: Sink, row: Mapping[str, Any], incident: Mapping[str, Any]
    ) -> None:
        rid, iid = row["id"], row["incident_id"]
        absorbed = [a["id"] for a in row["absorbed"]]
        try:
            silence = active_silence(store.conn, incident) if incident else None
            if silence is not None:
                raise Deferred(
                    f"{SILENCED} until {format_utc(silence['until'])} (silence {silence['id']})",
                    silence["until"],
                )
            remember = sink.deliver(row, incident)
        except Deferred as d:
            self._not_before[rid] = d.until
            self._inflight.discard(rid)
            log.info("%s: incident %s held: %s", sink.name, iid, d)
            self._put(Result(rid, False, str(d), d.until, deferred=True))
            return
        except DeliveryError as e:
            tries = row["attempts"] + 1
            error, permanent = str(e), e.permanent
            limit = getattr(sink, "max_attempts", {}).get(row["action"])
            if limit is not None and tries >= limit and not permanent:
                error, permanent = f"{error} (attempt {tries} of {limit}: given up)", True
            if e.retry_after is not None:
                # the service said when (HTTP 429 Retry-After, or a fix that needs a person)
                retry_at = time.time() + max(e.retry_after, 1.0)
            else:
                retry_at = time.time() + min(MAX_BACKOFF, 2.0 ** min(tries, 10))
            log.warning(
                "%s: delivery of incident %s failed (%s); %s",
                sink.name,
                iid,
                error,
                "giving up" if permanent else f"retry in {retry_at - time.time():.0f}s",
            )
            if permanent:
                self._done.add(rid)
            else:
                self._not_before[rid] = retry_at
            self._inflight.discard(rid)
            self._put(Result(rid, False, error, retry_at, permanent))
            return
        self._done.add(rid)
        self._done.update(absorbed)
        self._inflight.discard(rid)
        for sid in absorbed:
            self.results.put(Result(sid, True))
        self._put(Result(rid, True, remember=remember))
