"""The pipeline: sources -> detect -> store -> correlate -> notify. `scan` and `watch` share it.

One thread (the caller's) owns the write connection; the watcher thread only wakes it, the
sender thread only reads and reports back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..config import Config
from ..correlate import Change, Correlator
from ..errors import StoreError
from ..sources import Root, Tracker, make_roots
from ..store import Store
from ..store.db import damaged, is_damage
from .committer import Committer, Stats
from .passes import Passes

# `scan` reads once and, without --notify, delivers nothing: the watcher, the sender and the
# fleet forwarder load where `watch` (or a configured sink) first needs them
if TYPE_CHECKING:
    from ..detect import Detector, RuleSet
    from ..notify.forward import Forwarder
    from ..notify.outbox import Outbox, Result, Sender, Sink
    from ..sources.watcher import Watcher

log = logging.getLogger("nanwatch")

SAFETY_POLL = 30.0  # seconds between full checks when inotify is trusted
RETRY_FIRST, RETRY_CAP = 1.0, 60.0  # seconds between attempts while the database refuses
STOP_GRACE = 5.0  # seconds a pass may go on reading after a stop was asked for
# a busy node wakes the loop for every write of every rank: a live pass starts no sooner than
# this after the previous one began, so that it reads what several writes appended (a pass
# costs about as much for one line per file as for fifty: 8 ranks at 1,000 lines/s each cost
# a fifth less CPU at 60 ms than at 40). A line after a quiet spell is read at once; under load
# it waits at most this long (the latency bound is 100 ms at the 99th percentile).
LIVE_GAP = 0.06


class Backoff:
    """When to try again a database that refused a write: ``first`` seconds, doubling up to
    ``cap``. A disk stays full for minutes; trying every few seconds only burns a core."""

    def __init__(
        self,
        first: float = RETRY_FIRST,
        cap: float = RETRY_CAP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first, self.cap, self.clock = first, cap, clock
        self.delay = 0.0
        self._at: float | None = None

    def failed(self) -> float:
        """One more refusal: the delay until the next attempt."""
        self.delay = min(self.cap, self.delay * 2) if self.delay else self.first
        self._at = self.clock() + self.delay
        return self.delay

    def left(self) -> float:
        return 0.0 if self._at is None else max(0.0, self._at - self.clock())

    def due(self) -> bool:
        return self.left() <= 0.0

    def reset(self) -> None:
        self.delay, self._at = 0.0, None


class Pipeline:
    """Follows the given paths into the store. ``live`` means `watch` (files keep growing).

    A pass loop (``passes.Passes``) does the reading, committing and correlating; the pipeline
    repeats its passes as files change, survives an unwritable database, delivers what the
    passes queued, and swaps configuration between passes."""

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
        self.passes = Passes(
            config,
            store,
            paths,
            run=run,
            live=live,
            sinks=sinks,
            rules=rules,
            on_changes=on_changes,
        )
        self.retry = Backoff()  # tests give it a clock of their own
        self.mode = "scan"
        self.paused: str | None = None  # why the database could not be written, while it can't
        self._stop: threading.Event | None = None
        self._reconfigured = False
        # fleet mode: what `watch` commits goes on to the fleet store after its pass
        self.forwarder: Forwarder | None = None
        if live and config.fleet.dsn:
            from ..notify.forward import Forwarder
            from ..sources.identity import this_node

            self.forwarder = Forwarder(config, node=this_node(config.cluster.node))

    # -- what the passes hold (read by the CLI, the daemon's status and tests) -------------------

    @property
    def config(self) -> Config:
        return self.passes.config

    @property
    def store(self) -> Store:
        return self.passes.store

    @property
    def live(self) -> bool:
        return self.passes.live

    @property
    def roots(self) -> list[Root]:
        return self.passes.roots

    @property
    def tracker(self) -> Tracker:
        return self.passes.tracker

    @property
    def stats(self) -> Stats:
        return self.passes.stats

    @property
    def detector(self) -> Detector:
        return self.passes.detector

    @property
    def correlator(self) -> Correlator:
        return self.passes.correlator

    @property
    def committer(self) -> Committer:
        return self.passes.committer

    @property
    def outbox(self) -> Outbox | None:
        return self.passes.outbox

    @property
    def sinks(self) -> list[Sink]:
        return self.passes.sinks

    @property
    def wake(self) -> threading.Event:
        return self.passes.wake

    @property
    def on_progress(self) -> Callable[[], None] | None:
        """Called on the writer thread after every commit (a catch-up's progress bar)."""
        return self.passes.committer.on_progress

    @on_progress.setter
    def on_progress(self, hook: Callable[[], None] | None) -> None:
        self.passes.committer.on_progress = hook

    @property
    def now_utc(self) -> Callable[[], str]:
        """When events count as read (their ``ingested_at``); a replay sets its own clock."""
        return self.passes.committer.now_utc

    @now_utc.setter
    def now_utc(self, clock: Callable[[], str]) -> None:
        self.passes.committer.now_utc = clock

    def step(
        self, *, final: bool = False, discover: bool = True, only: Iterable[str] | None = None
    ) -> list[Change]:
        """One pass (see ``Passes.step``)."""
        return self.passes.step(final=final, discover=discover, only=only)

    def scan(self) -> list[Change]:
        """Read every file to its end once (unterminated last lines included)."""
        return self.passes.scan()

    def run_ids(self) -> list[int]:
        return self.passes.run_ids()

    def counters(self) -> dict[str, int]:
        return self.passes.counters()

    # -- stop and deliver ------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask a running `watch` to commit what it has read and return (signal-safe).

        A pass under way goes on reading for at most ``STOP_GRACE`` seconds more: a stop in
        the middle of a long catch-up commits what was read and leaves the rest for the next
        start."""
        if self.passes.stop_by is None:
            self.passes.stop_by = time.monotonic() + STOP_GRACE
        if self._stop is not None:
            self._stop.set()
        self.wake.set()

    def deliver_all(self, *, deadline: float = 600.0) -> int:
        """Deliver every queued notification now (scan --notify); returns what is still queued."""
        outbox = self.outbox
        if outbox is None:
            return 0
        from ..notify.outbox import Sender

        sender = Sender(str(self.store.path), self.sinks)
        reader = Store.open(self.store.path, readonly=True)
        end = time.monotonic() + deadline
        try:
            while time.monotonic() < end:
                sender.deliver_due(reader)
                self._record(sender.drain_results())
                # rows held by a silence wait for it to end, not for this scan
                left, first_due = outbox.waiting()
                if not left:
                    return 0
                wait = max(0.05, min((first_due or 0) - time.time(), end - time.monotonic()))
                time.sleep(min(wait, 60.0))
        finally:
            reader.close()
        return outbox.pending(include_silenced=False)

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
        them (a pass paused on an unwritable database still ticks: it is alive and says why).
        ``reconfigure()`` called from ``on_tick`` takes effect before the next pass.
        """
        from ..notify.outbox import Sender
        from ..sources.watcher import Watcher, choose_mode

        mode, reason = choose_mode(self.config.sources.mode, self.roots)
        self._stop = stop
        wake = self.wake
        watcher = Watcher(self.roots, wake)
        if mode == "inotify" and not watcher.start():
            mode, reason = "poll", "inotify watches could not be added (see fs.inotify limits)"
        log.info("following %d path(s) by %s (%s)", len(self.roots), mode, reason)
        self.mode = mode
        # the sender wakes this loop so results (a posted message's ts) are stored promptly
        sender = Sender(str(self.store.path), self.sinks, notify=wake.set) if self.sinks else None
        if sender is not None:
            sender.start()
        try:
            self._safe_step()
            if mode == "inotify":
                watcher.follow(self.tracker.link_dirs(), files=self._followed())
            if on_ready is not None:
                on_ready()
            last_full = last_pass = time.monotonic()
            followed = len(self.tracker.records)
            while not stop.is_set():
                poll = self.config.sources.poll_interval
                timeout = poll if mode == "poll" else SAFETY_POLL
                if tick is not None:
                    timeout = min(timeout, tick)
                if any(r.status == "pending" for r in self.tracker.records.values()):
                    timeout = min(timeout, 1.0)
                if self.paused is not None:
                    timeout = min(timeout, max(self.retry.left(), 0.05))
                if self.forwarder is not None:
                    timeout = min(timeout, self.forwarder.heartbeat)
                deadline = time.monotonic() + timeout
                while not stop.is_set() and not wake.is_set():
                    # short slices so an external `stop` is seen promptly; no work is done here
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wake.wait(min(left, 0.5))
                gap = LIVE_GAP - (time.monotonic() - last_pass)
                if mode == "inotify" and gap > 0 and not stop.is_set():
                    stop.wait(gap)
                wake.clear()
                if stop.is_set():
                    break
                last_pass = time.monotonic()
                dirty, structural = watcher.take()
                now = time.monotonic()
                full = (
                    mode == "poll"
                    or structural
                    or self.paused is not None  # what the failed pass read must be read again
                    or now - last_full >= SAFETY_POLL
                )
                if structural:
                    watcher.rescan_roots()
                if self.paused is not None and not self.retry.due():
                    changes = None  # woken while the database refuses: wait for the turn
                else:
                    changes = self._safe_step(discover=full, only=None if full else dirty)
                if mode == "inotify":
                    # the followed files change with a full pass (or one that found renames)
                    moved = full or len(self.tracker.records) != followed
                    watcher.follow(
                        self.tracker.link_dirs(), files=self._followed() if moved else None
                    )
                followed = len(self.tracker.records)
                if changes is not None:
                    if full:
                        last_full = now
                    if sender is not None and self.outbox is not None:
                        self._record(sender.drain_results())
                        if self.outbox.enqueue_reminders() or changes:
                            sender.wake.set()
                self._forward(committed=changes is not None)
                if on_tick is not None:
                    on_tick()
                if self._reconfigured:
                    self._reconfigured = False
                    mode = self._rewatch(watcher, mode)
                    sender = self._resend(sender)
                    wake.set()  # read the new sources now
                    last_full = 0.0
            # drain: whatever was written up to now is committed before exit
            self._safe_step()
            self._forward(committed=True)
        finally:
            watcher.stop()
            if self.forwarder is not None:
                self.forwarder.close()
            if sender is not None:
                sender.wake.set()
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and self.outbox is not None:
                    self._record(sender.drain_results())
                    if not self.outbox.due(time.time()):
                        break
                    time.sleep(0.05)
                # longer than a sink's HTTP timeout: a reply that arrives is recorded, not lost
                sender.stop(timeout=15.0)
                self._record(sender.drain_results())
            self.tracker.close()

    def _followed(self) -> list[str]:
        return [rec.path for rec in self.tracker.records.values()]

    def _forward(self, *, committed: bool) -> None:
        """Fleet mode: forward after a pass that committed (at most once a second), and at
        least once per heartbeat; a fleet store that is down costs one bounded attempt per
        back-off step and loses nothing."""
        fwd = self.forwarder
        now = time.time()
        if fwd is not None and fwd.due(now, committed=committed):
            fwd.forward(self.store, now=now)

    def _record(self, results: list[Result]) -> None:
        """Record delivery results (writer thread) and count them for the metrics."""
        if not results:
            return
        from ..notify.outbox import Outbox

        for r in results:
            self.stats.deliveries["ok" if r.ok else "given_up" if r.permanent else "failed"] += 1
        (self.outbox or Outbox(self.store, self.sinks)).record(results)

    # -- reload ----------------------------------------------------------------------------------

    def reconfigure(
        self,
        config: Config,
        paths: Sequence[str],
        *,
        rules: RuleSet | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> None:
        """Swap config, sources, rules and sinks between passes (SIGHUP), keeping every offset
        (``Passes.reconfigure`` says what happens to each file)."""
        roots = make_roots(list(paths), must_exist=not self.live)
        self.passes.reconfigure(config, roots, rules=rules, sinks=sinks)
        self._reconfigured = True
        self.wake.set()

    def _rewatch(self, watcher: Watcher, mode: str) -> str:
        """After a reload: watch new roots, forget old ones, pick the mode again."""
        from ..sources.watcher import choose_mode

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
        from ..notify.outbox import Sender

        sender = Sender(str(self.store.path), self.sinks, notify=self.wake.set)
        sender.start()
        return sender

    def _safe_step(
        self, *, discover: bool = True, only: Iterable[str] | None = None
    ) -> list[Change] | None:
        """A step that survives an unwritable database (disk full, I/O error): nothing is
        committed, so nothing is lost; the daemon says so once, waits and tries again."""
        try:
            changes = self.step(discover=discover, only=only)
        except StoreError as e:
            if e.damaged:
                raise  # a corrupt file does not heal: stop, and let the message say how to recover
            delay = self.retry.failed()
            if self.paused != str(e):
                log.error(
                    "%s; paused: nothing read is lost, trying again in %.0f s (then at most "
                    "every %.0f s)",
                    e,
                    delay,
                    self.retry.cap,
                )
            self.paused = str(e)
            return None
        except Exception as e:
            if is_damage(e):  # SQLite's own error, met by a read
                raise damaged(self.store.path, str(e)) from None
            raise
        self.retry.reset()
        if self.paused is not None:
            log.warning("the database is writable again; resumed")
            self.paused = None
        return changes
