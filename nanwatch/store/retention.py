"""Retention: ``[store] keep`` and ``max_size``, in small batches on the writer thread.

What goes: incidents resolved before the cutoff (with their outbox rows and messages), events
ingested before it that no remaining incident holds, metric blocks older than it (aged by
hourly block id marks: blocks carry no ingestion time), delivered outbox rows, lapsed silences,
retired sources nothing refers to. Over ``max_size`` the oldest metric blocks go first, then
the oldest events no open incident holds. Counts are of iterations (a block holds a chunk's).
Freed pages go back to the filesystem through ``PRAGMA incremental_vacuum`` (databases are
created with auto_vacuum=INCREMENTAL).
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from ..config import StoreConfig
from ..events import format_utc
from .db import Store

log = logging.getLogger("nanwatch.store")


class Housekeeper:
    """``[store] keep`` and ``max_size``: a pass every few minutes, in small batches.

    Runs on the writer thread (one writer) within a time budget per tick, so detection never
    waits long behind it; ``step()`` says whether to come back soon.
    """

    EVERY = 600.0
    BUDGET = 0.05

    def __init__(self, store: Store, config: StoreConfig) -> None:
        self.store = store
        self.config = config
        self.deleted: Counter[str] = Counter()
        self._stage: str | None = None
        self._next = 0.0
        self._cursor = 0
        self._cutoff = ""
        self._cutoff_ts = 0.0
        self._pass: Counter[str] = Counter()

    def reconfigure(self, config: StoreConfig) -> None:
        """New limits (a reload): the next step starts a pass with them."""
        self.config = config
        self._next = 0.0

    def step(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if self._stage is None:
            if now < self._next:
                return False
            self._next = now + self.EVERY
            if self.config.keep is None and self.config.max_size is None:
                return False
            self._start(now)
        deadline = time.monotonic() + self.BUDGET
        while self._stage is not None and time.monotonic() < deadline:
            self._work(now)
        return self._stage is not None

    def _start(self, now: float) -> None:
        self._pass = Counter()
        self._cursor = 0
        if self.config.keep is not None:
            self._cutoff_ts = now - self.config.keep
            self._cutoff = format_utc(self._cutoff_ts)
            self.store.add_metric_mark(now, keep=self.config.keep)
            self._stage = "incidents"
        else:
            self._stage = "trim"

    def _work(self, now: float) -> None:
        st = self.store
        if self._stage == "incidents":
            n = st.expire_incidents(self._cutoff)
            self._count("incidents", n)
            if not n:
                self._stage = "events"
        elif self._stage == "events":
            n, self._cursor = st.expire_events(self._cutoff, after_id=self._cursor)
            self._count("events", n)
            if self._cursor < 0:
                self._stage = "metrics"
        elif self._stage == "metrics":
            old = [i for t, i in st.metric_marks() if t < self._cutoff_ts]
            n = st.expire_metrics(old[-1]) if old else 0
            self._count("metrics", n)
            if not n:
                self._stage = "misc"
        elif self._stage == "misc":
            self._count("other", st.expire_misc(self._cutoff, self._cutoff_ts))
            self._stage = "trim"
        elif self._stage == "trim":
            cap = self.config.max_size
            used = st.size_info()["used"]
            # hysteresis: once over the cap, go down to 90% of it
            if cap is not None and (used > cap or (self._pass["trimmed"] and used > cap * 0.9)):
                n = st.trim_oldest()
                if not self._pass["trimmed"]:
                    log.warning(
                        "database %s holds %.0f MB, above [store] max_size (%.0f MB): deleting "
                        "the oldest metrics and events",
                        st.path,
                        used / 1e6,
                        cap / 1e6,
                    )
                self._count("trimmed", n)
                if not n:
                    log.warning("database still above max_size: only open incidents' rows left")
                    self._stage = "vacuum"
            else:
                self._stage = "vacuum"
        elif self._stage == "vacuum" and not st.vacuum_step():
            self._stage = None
            if self._pass:
                log.info(
                    "retention: deleted %s",
                    ", ".join(f"{n} {t}" for t, n in sorted(self._pass.items())),
                )

    def _count(self, table: str, n: int) -> None:
        if n:
            self._pass[table] += n
            self.deleted[table] += n


def cap_wal(store: Store, size: int = 64 * 1024 * 1024) -> None:
    """Let the WAL file shrink back to ``size`` bytes after a checkpoint instead of keeping
    its peak size (a long scan can grow it to gigabytes); the daemon sets it at start."""
    store.execute(f"PRAGMA journal_size_limit={int(size)}")
