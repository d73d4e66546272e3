"""The SQLite store: one writer connection (WAL), numbered migrations, typed helpers.

``PRAGMA synchronous=NORMAL`` in WAL mode is chosen on purpose: a process crash (kill -9)
loses nothing that was committed, and a power loss can only lose the last transactions
*together with their offsets*, so the next start re-reads those bytes and re-creates exactly
the same event rows (invariants 1 and 2). FULL would add an fsync per commit for no gain.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..events import Event, now_utc
from . import files
from .records import EVENT_COLUMNS

if TYPE_CHECKING:
    from .metrics import MetricColumns, Packed
from .schema import MIGRATIONS

SCHEMA_VERSION = len(MIGRATIONS)
log = logging.getLogger("nanwatch.store")
_TIMESTAMP_LAUNCH = re.compile(r"(?:^|/)\d{8}_\d{6}$")  # mmengine's launch folders


_EVENT_KEYS = tuple(c.strip() for c in EVENT_COLUMNS.split(","))


def recovery_steps(path: Path | str) -> str:
    """What to do with a damaged database file (``doctor`` and every error say the same)."""
    return (
        f"stop nanwatch, move the file aside (mv {path} {path}.bad), then either start afresh "
        f"(offsets restart, logs are read again) or salvage it with: "
        f"sqlite3 {path}.bad .recover | sqlite3 {path}"
    )


def is_damage(e: BaseException) -> bool:
    """SQLite's own words for a corrupt file (SQLITE_CORRUPT, SQLITE_NOTADB)."""
    msg = str(e)
    return isinstance(e, sqlite3.DatabaseError) and ("not a database" in msg or "malformed" in msg)


def damaged(path: Path | str, what: str) -> StoreError:
    return StoreError(
        f"{path}: the database is damaged ({what}). Recovery: {recovery_steps(path)}",
        damaged=True,
    )


# The check at open reads every page once; on a very large file it stops after this long and
# the open goes on (a damaged page met later is still reported, then, by the pass that meets it).
_CHECKED: set[str] = set()  # databases this process's writer checked at open
CHECK_BUDGET = 10.0  # seconds, for the writer (`watch`, `scan`)
# seconds, for read commands, which should answer at once: on a big file the check covers its
# first pages only, and damage met later by a query still gets the damaged message (the CLI's
# error handler); a whole second here made every `incidents` on a 600 MB database take 1 s
READ_CHECK_BUDGET = 0.1
# quick_check cannot be interrupted inside its page walk: above this size readers skip it
READ_CHECK_MAX = 64 << 20


def check_integrity(conn: sqlite3.Connection, path: Path, budget: float) -> bool:
    """``PRAGMA quick_check`` bounded by ``budget`` seconds: raise the damaged StoreError when
    it finds a problem; False when it ran out of time (unchecked), True when intact."""
    deadline = time.monotonic() + budget
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10000)
    try:
        rows = conn.execute("PRAGMA quick_check(3)").fetchall()
    except sqlite3.OperationalError as e:
        if "interrupt" in str(e):
            return False
        raise
    except sqlite3.DatabaseError as e:
        raise damaged(path, str(e)) from None
    finally:
        conn.set_progress_handler(None, 0)
    problems = [" ".join(str(r[0]).split()) for r in rows if r and r[0] != "ok"]
    if problems:
        raise damaged(path, "; ".join(problems[:2])[:300])
    return True


def _explain(path: Path, e: sqlite3.Error) -> StoreError:
    msg = str(e)
    if is_damage(e):
        return damaged(path, msg)
    if "locked" in msg or "busy" in msg:
        return StoreError(
            f"{path}: the database is locked by another writer ({msg}); only one `nanwatch "
            "watch`/`scan` may write a database at a time: stop the other one or use --db"
        )
    if "disk is full" in msg or "disk I/O" in msg:
        return StoreError(f"{path}: cannot write the database ({msg}); free disk space")
    if "readonly" in msg or "unable to open" in msg:
        return StoreError(
            f"{path}: cannot open the database for writing ({msg}); check the folder's "
            "permissions or pass another --db"
        )
    return StoreError(f"{path}: database error: {msg}")


class WriterLock:
    """One writing process per database: an flock on the database file itself.

    Keyed on the file, not its name: a symlink, a hard link, a bind mount or a relative path
    to a database being written is refused (a second writer through a hard link keeps its own
    WAL and damages the file). flock does not meet SQLite's own fcntl byte-range locks on a
    local filesystem, so readers are never blocked. The descriptor is closed only after the
    connection: closing any descriptor of a file drops the process's fcntl locks on it."""

    def __init__(self, db_path: Path, mode: int = 0o600) -> None:
        self.path = db_path
        self.mode = mode  # when the lock creates the database file
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:
            # an empty file is an empty database to SQLite: creating it here changes nothing
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), self.mode)
        except OSError as e:
            raise StoreError(
                f"{self.path}: cannot open the database for writing ({e.strerror}); check the "
                "folder's permissions or pass another --db"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            holder = _flock_holder(st.st_dev, st.st_ino)
            who = f"pid {holder}" if holder is not None else "pid unknown"
            raise StoreError(
                f"{self.path}: another nanwatch process ({who}) is writing this database "
                "(the same file, under this name or another: a link or a relative path); "
                "stop it, or pass another --db"
            ) from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _close_quietly(conn: sqlite3.Connection | None) -> None:
    if conn is not None:
        try:
            conn.close()
        except sqlite3.Error:
            pass


def _flock_holder(dev: int, ino: int, locks: str = "/proc/locks") -> int | None:
    """The pid holding an flock on the file (dev, ino), from the kernel's lock table.

    The table names the device as its superblock knows it, which stat does not always report
    (btrfs subvolumes): one flock on the same inode number is taken to be it."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    same_ino: list[int] = []
    try:
        with open(locks, encoding="ascii", errors="replace") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2153162 0 EOF" ("->" marks waiters)
                if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
                    continue
                if parts[5] == want:
                    return int(parts[4])
                if parts[5].rsplit(":", 1)[-1] == str(ino):
                    same_ino.append(int(parts[4]))
    except (OSError, ValueError):
        return None
    return same_ino[0] if len(same_ino) == 1 else None


class Store:
    """Owns one connection. The writer thread uses it for every write (invariant 5)."""

    last_opened: Path | None = None  # for the CLI's message when a query meets a damaged page

    def __init__(self, path: Path, conn: sqlite3.Connection, *, readonly: bool) -> None:
        self.path = path
        self._conn = conn
        self.readonly = readonly
        self._in_tx = False
        self.lock: WriterLock | None = None

    # -- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, readonly: bool = False, exclusive: bool = True
    ) -> Store:
        """Open (and migrate) the database. ``exclusive`` takes the writer lock that keeps a
        second daemon or scan out; a one-row write from the CLI (a silence) passes False and
        relies on SQLite's own locking for its single transaction."""
        p = Path(path)
        Store.last_opened = p
        if readonly:
            if files.unreadable(p):
                raise files.denied(p)
            if not p.exists():
                raise StoreError(
                    f"{p}: no database here yet; run `nanwatch scan PATH` or `nanwatch watch` "
                    "first, or pass the right --db"
                )
            uri = f"file:{p}?mode=ro"
            try:
                conn = sqlite3.connect(
                    uri, uri=True, isolation_level=None, timeout=5.0, check_same_thread=False
                )
                conn.execute("PRAGMA query_only=ON")
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                if (
                    version >= SCHEMA_VERSION
                    and str(p) not in _CHECKED
                    and p.stat().st_size <= READ_CHECK_MAX
                ):
                    check_integrity(conn, p, READ_CHECK_BUDGET)
            except sqlite3.Error as e:
                if "readonly" in str(e) and not os.path.exists(f"{p}-shm"):
                    raise StoreError(
                        f"{p}: cannot be read while no nanwatch is writing it: a reader needs "
                        f"the {p.name}-shm file that `watch` keeps, and may not create it in "
                        f"{p.parent}; start the service, or run the command as its user "
                        "(sudo -u nanwatch nanwatch ...)"
                    ) from None
                raise _explain(p, e) from None
            except StoreError:
                conn.close()
                raise
            if version < SCHEMA_VERSION:
                conn.close()
                # an older schema: open it writable once to migrate
                return cls.open(p, readonly=False)
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{p}: written by a newer nanwatch (schema {version} > {SCHEMA_VERSION}); "
                    "upgrade nanwatch"
                )
            store = cls(p, conn, readonly=True)
            return store
        files.make_folder(p.parent)
        mode = files.prepare(p)
        lock = WriterLock(p, mode)
        if exclusive:
            lock.acquire()
        wconn: sqlite3.Connection | None = None  # closed before the lock on failure
        try:
            wconn = sqlite3.connect(
                str(p), isolation_level=None, timeout=5.0, check_same_thread=False
            )
            if not check_integrity(wconn, p, CHECK_BUDGET):
                log.info("%s: too large to check in %.0f s at start; not checked", p, CHECK_BUDGET)
            _CHECKED.add(str(p))  # this process's readers need not check it again
            if wconn.execute("PRAGMA user_version").fetchone()[0] == 0:
                # a fresh file: auto_vacuum must be chosen before the first page is written,
                # and switching to WAL writes one
                wconn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            wconn.execute("PRAGMA journal_mode=WAL")
            wconn.execute("PRAGMA synchronous=NORMAL")
            wconn.execute("PRAGMA foreign_keys=OFF")
            wconn.execute("PRAGMA busy_timeout=5000")
            store = cls(p, wconn, readonly=False)
            store.lock = lock
            store._migrate()
        except sqlite3.Error as e:
            _close_quietly(wconn)
            lock.release()
            raise _explain(p, e) from None
        except BaseException:
            _close_quietly(wconn)
            lock.release()
            raise
        return store

    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: written by a newer nanwatch (schema {version} > {SCHEMA_VERSION}); "
                "upgrade nanwatch"
            )
        for number in range(version, SCHEMA_VERSION):
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                step = MIGRATIONS[number]
                if callable(step):
                    step(self._conn)
                else:
                    for statement in _split(step):
                        self._conn.execute(statement)
                self._conn.execute(f"PRAGMA user_version={number + 1}")
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        try:
            if not self.readonly:
                self._conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass
        self._conn.close()
        if self.lock is not None:
            self.lock.release()

    # -- transactions ----------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._in_tx:
            yield
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise _explain(self.path, e) from None
        self._in_tx = True
        try:
            yield
        except BaseException as e:
            self._in_tx = False
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(e, sqlite3.Error):
                raise _explain(self.path, e) from None
            raise
        self._in_tx = False
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise _explain(self.path, e) from None

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.Error as e:
            raise _explain(self.path, e) from None

    # -- meta ------------------------------------------------------------------------------------

    def meta_get(self, key: str, default: str | None = None) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def meta_set(self, key: str, value: str) -> None:
        self.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )

    # -- runs ------------------------------------------------------------------------------------

    def run_id(
        self,
        root: str,
        launch: str,
        name: str,
        *,
        experiment: str | None = None,
        node: str | None = None,
        job: str | None = None,
    ) -> int:
        row = self._conn.execute(
            "SELECT id FROM runs WHERE root=? AND launch=?", (root, launch)
        ).fetchone()
        if row:
            return int(row[0])
        if _TIMESTAMP_LAUNCH.search(launch):
            # The PATH's first mmengine launch folder: files that got bytes before it existed
            # (a launcher's banner on the captured stdout) went to the PATH's own run; that run
            # becomes this launch's run instead of being split from it. (msprobe relaunches are
            # different: there the PATH's own run is the first launch.)
            only = self._conn.execute(
                "SELECT id FROM runs WHERE root=? AND launch='' AND NOT EXISTS "
                "(SELECT 1 FROM runs r2 WHERE r2.root=? AND r2.launch != '')",
                (root, root),
            ).fetchone()
            if only:
                with self.transaction():
                    taken = self._conn.execute(
                        "SELECT 1 FROM runs WHERE name=? AND id != ?", (name, only[0])
                    ).fetchone()
                    self.execute(
                        "UPDATE runs SET launch=?, name=?, experiment=coalesce(?, experiment) "
                        "WHERE id=?",
                        (launch, f"{name}~{only[0]}" if taken else name, experiment, only[0]),
                    )
                return int(only[0])
        base, n = name, 1
        with self.transaction():
            while self._conn.execute("SELECT 1 FROM runs WHERE name=?", (name,)).fetchone():
                n += 1
                name = f"{base}~{n}"
            cur = self.execute(
                "INSERT INTO runs(name, root, launch, experiment, node, job, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, root, launch, experiment, node, job, now_utc()),
            )
        return int(cur.lastrowid or 0)

    def run_by_name(self, name: str) -> dict[str, Any] | None:
        row = self._conn.execute("SELECT * FROM runs WHERE name=?", (name,)).fetchone()
        return self._row(row, "runs") if row else None

    def update_run_facts(self, run_id: int, facts: Mapping[str, Any]) -> None:
        row = self._conn.execute("SELECT facts FROM runs WHERE id=?", (run_id,)).fetchone()
        current = json.loads(row[0]) if row and row[0] else {}
        merged = _deep_merge(current, facts)
        self.execute("UPDATE runs SET facts=? WHERE id=?", (json.dumps(merged), run_id))

    def widen_run_span(self, run_id: int, times: Iterable[str | None]) -> None:
        """Stretch a run's first_time/last_time (what its logs span) over ``times`` (RFC 3339
        UTC strings, which compare as text); in the caller's transaction."""
        known = [t for t in times if t]
        if not known:
            return
        lo, hi = min(known), max(known)
        self.execute(
            "UPDATE runs SET first_time = CASE WHEN first_time IS NULL OR first_time > ? "
            "THEN ? ELSE first_time END, last_time = CASE WHEN last_time IS NULL OR "
            "last_time < ? THEN ? ELSE last_time END WHERE id = ?",
            (lo, lo, hi, hi, run_id),
        )

    # -- sources ---------------------------------------------------------------------------------

    def load_sources(self) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            # other nodes' files (a merged database) are history, never followed here
            "SELECT * FROM sources WHERE status IN ('active', 'truncated', 'rotated') AND node = ''"
        ).fetchall()
        return [self._row(r, "sources") for r in rows]

    def save_source(
        self,
        rec: Any,
        *,
        offset: int,
        tail_hash: str | None,
        head_hash: str | None,
        head_len: int,
        cutting: bool,
        ctx: str,
        status: str | None = None,
    ) -> int:
        now = now_utc()
        if rec.id is None:
            cur = self.execute(
                "INSERT INTO sources(run_id, path, root, dev, ino, gen, offset, head_hash, "
                "head_len, tail_hash, cutting, lines_cut, status, ctx, created_at, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT(dev, ino, gen, node) DO UPDATE SET path=excluded.path",
                (
                    rec.run_id,
                    rec.path,
                    rec.root.spec,
                    rec.dev,
                    rec.ino,
                    rec.gen,
                    offset,
                    head_hash,
                    head_len,
                    tail_hash,
                    int(cutting),
                    rec.lines_cut,
                    status or rec.status,
                    ctx,
                    now,
                    now,
                ),
            )
            row = self._conn.execute(
                "SELECT id FROM sources WHERE dev=? AND ino=? AND gen=? AND node=''",
                (rec.dev, rec.ino, rec.gen),
            ).fetchone()
            rec.id = int(row[0]) if row else int(cur.lastrowid or 0)
            if row is not None:
                self.execute(
                    "UPDATE sources SET offset=?, tail_hash=?, head_hash=?, head_len=?, cutting=?, "
                    "ctx=?, status=?, updated_at=?, run_id=? WHERE id=?",
                    (
                        offset,
                        tail_hash,
                        head_hash,
                        head_len,
                        int(cutting),
                        ctx,
                        status or rec.status,
                        now,
                        rec.run_id,
                        rec.id,
                    ),
                )
            return int(rec.id)
        self.execute(
            "UPDATE sources SET path=?, offset=?, tail_hash=?, head_hash=?, head_len=?, cutting=?, "
            "lines_cut=?, ctx=?, status=?, updated_at=?, run_id=coalesce(?, run_id) WHERE id=?",
            (
                rec.path,
                offset,
                tail_hash,
                head_hash,
                head_len,
                int(cutting),
                rec.lines_cut,
                ctx,
                status or rec.status,
                now,
                rec.run_id,
                rec.id,
            ),
        )
        return int(rec.id)

    def next_gen(self, dev: int, ino: int) -> int:
        """The next generation number for a file identity (inodes are reused)."""
        row = self._conn.execute(
            "SELECT max(gen) FROM sources WHERE dev = ? AND ino = ? AND node = ''", (dev, ino)
        ).fetchone()
        return 0 if row is None or row[0] is None else int(row[0]) + 1

    def set_source_status(self, source_id: int, status: str) -> None:
        self.execute(
            "UPDATE sources SET status=?, updated_at=? WHERE id=?", (status, now_utc(), source_id)
        )

    # -- events and metrics ----------------------------------------------------------------------

    def insert_events(
        self, run_id: int | None, source_id: int | None, events: Iterable[Event], ingested_at: str
    ) -> int:
        rows = [
            (
                e.kind,
                e.time,
                ingested_at,
                run_id,
                source_id,
                e.offset,
                e.key,
                e.line,
                e.rank,
                e.local_rank,
                e.node,
                e.epoch,
                e.iter,
                e.step,
                e.stage,
                e.device,
                e.message,
                json.dumps(dict(e.fields), default=str, separators=(",", ":")),
            )
            for e in events
        ]
        if not rows:
            return 0
        before = self._conn.total_changes
        self._conn.executemany(
            "INSERT OR IGNORE INTO events(kind, time, ingested_at, run_id, source_id, offset, key, "
            "line, rank, local_rank, node, epoch, iter, step, stage, device, message, fields) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        return self._conn.total_changes - before

    def insert_metrics(
        self,
        run_id: int | None,
        source_id: int | None,
        metrics: Iterable[tuple[Any, ...]] | Packed,
    ) -> int:
        """Metrics (or plain tuples in Metric's field order, or a chunk packed by ``pack``:
        what detection workers send), in the caller's transaction; returns how many were new
        (see ``store/metric_writer.py``)."""
        from .metrics import Metrics, Packed

        if isinstance(metrics, Packed):
            return Metrics(self).insert_packed(run_id, source_id, metrics)
        return Metrics(self).insert(run_id, source_id, metrics)

    def insert_metric_columns(
        self, run_id: int | None, source_id: int | None, columns: MetricColumns
    ) -> int:
        """One chunk's metrics as parallel columns (a parser that builds columns directly)."""
        from .metrics import Metrics

        return Metrics(self).insert_columns(run_id, source_id, columns)

    def max_event_id(self) -> int:
        row = self._conn.execute("SELECT max(id) FROM events").fetchone()
        return int(row[0] or 0)

    def events_after(self, last_id: int, limit: int = 100000) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?", (last_id, limit)
        ).fetchall()
        return [self._event(r) for r in rows]

    # -- retention (the daemon's writer thread calls these in small batches) ---------------------

    def expire_incidents(self, before: str, *, limit: int = 500) -> int:
        """Delete incidents resolved before ``before`` (RFC 3339), their outbox and messages."""
        ids = [
            r[0]
            for r in self._conn.execute(
                "SELECT id FROM incidents WHERE status = 'resolved' AND resolved_at < ? LIMIT ?",
                (before, limit),
            )
        ]
        if not ids:
            return 0
        marks = ",".join("?" * len(ids))
        with self.transaction():
            self.execute(f"DELETE FROM outbox WHERE incident_id IN ({marks})", ids)
            self.execute(f"DELETE FROM messages WHERE incident_id IN ({marks})", ids)
            self.execute(f"DELETE FROM incidents WHERE id IN ({marks})", ids)
        return len(ids)

    def expire_events(
        self, before: str, *, after_id: int = 0, limit: int = 2000
    ) -> tuple[int, int]:
        """Delete events ingested before ``before`` that no remaining incident holds.

        Scans ``limit`` rows by id from ``after_id`` and returns (deleted, next id to scan from),
        next = -1 when the scan reached events newer than ``before``: ``ingested_at`` grows with
        the id, so no index on it is needed and a pass never reads the young part of the table.
        Events of incidents still present (open, or resolved recently) stay with them.
        """
        rows = self._conn.execute(
            "SELECT e.id, e.ingested_at, i.id IS NOT NULL FROM events e "
            "LEFT JOIN incidents i ON i.id = e.incident_id WHERE e.id > ? ORDER BY e.id LIMIT ?",
            (after_id, limit),
        ).fetchall()
        dead: list[int] = []
        nxt = -1 if len(rows) < limit else int(rows[-1][0])
        for rid, ingested, held in rows:
            if ingested >= before:
                nxt = -1
                break
            if not held:
                dead.append(int(rid))
        if dead:
            with self.transaction():
                self._conn.executemany("DELETE FROM events WHERE id = ?", [(i,) for i in dead])
        return len(dead), nxt

    def expire_metrics(self, upto_id: int, *, limit: int = 64) -> int:
        """Delete metric blocks with ids up to ``upto_id``, oldest first; returns how many
        iterations went."""
        from .metrics import Metrics

        return Metrics(self).expire(upto_id, limit=limit)

    def expire_misc(self, before: str, before_ts: float, *, limit: int = 2000) -> int:
        """Delivered outbox rows, lapsed silences and retired sources older than the cutoff."""
        n = 0
        with self.transaction():
            n += self.execute(
                "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox WHERE delivered_at IS NOT "
                "NULL AND created_at < ? LIMIT ?)",
                (before, limit),
            ).rowcount
            n += self.execute("DELETE FROM silences WHERE until < ?", (before_ts,)).rowcount
            # a retired file's row goes once nothing refers to it (its offsets are useless now)
            n += self.execute(
                "DELETE FROM sources WHERE id IN (SELECT s.id FROM sources s WHERE s.status NOT "
                "IN ('active', 'truncated', 'rotated') AND s.updated_at < ? AND NOT EXISTS "
                "(SELECT 1 FROM events e WHERE e.source_id = s.id) AND NOT EXISTS "
                "(SELECT 1 FROM metric_blocks m WHERE m.source_id = s.id) LIMIT ?)",
                (before, limit),
            ).rowcount
        return max(n, 0)

    def trim_oldest(self, *, limit: int = 5000) -> int:
        """Over the size cap: delete the oldest metric rows, then the oldest events that no open
        incident holds. Returns how many rows went (0: nothing left that may go)."""
        from .metrics import Metrics

        n = Metrics(self).trim_oldest(limit=max(1, limit // 1000))
        if n > 0:
            return n
        with self.transaction():
            cur = self.execute(
                "DELETE FROM events WHERE id IN (SELECT e.id FROM events e LEFT JOIN incidents i "
                "ON i.id = e.incident_id AND i.status = 'open' WHERE i.id IS NULL "
                "ORDER BY e.id LIMIT ?)",
                (limit,),
            )
        return max(cur.rowcount, 0)

    def metric_marks(self) -> list[tuple[float, int]]:
        """(unix time, highest metric block id then): metric blocks carry no ingestion time of
        their own, so retention ages them by these marks, written at most hourly."""
        raw = self.meta_get("retention_marks")
        return [(float(t), int(i)) for t, i in json.loads(raw)] if raw else []

    def add_metric_mark(self, now: float, *, every: float = 3600.0, keep: float) -> None:
        marks = self.metric_marks()
        if marks and now - marks[-1][0] < every:
            return
        from .metrics import Metrics

        top = Metrics(self).last_block()
        marks.append((now, int(top)))
        # marks older than the cutoff are needed only up to the newest of them
        old = [m for m in marks if m[0] < now - keep]
        marks = old[-1:] + [m for m in marks if m[0] >= now - keep]
        with self.transaction():
            self.meta_set("retention_marks", json.dumps(marks))

    def vacuum_step(self, pages: int = 256) -> int:
        """Give up to ``pages`` free pages back to the filesystem (auto_vacuum=INCREMENTAL)."""
        before = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
        if not before:
            return 0
        # each step of this pragma frees one page: read it to the end
        self.execute(f"PRAGMA incremental_vacuum({int(pages)})").fetchall()
        after = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
        return int(before - after)

    def size_info(self) -> dict[str, int]:
        """Bytes: ``used`` (live pages), ``free`` (freelist), ``file`` and ``wal`` on disk."""
        page = self._conn.execute("PRAGMA page_size").fetchone()[0]
        count = self._conn.execute("PRAGMA page_count").fetchone()[0]
        free = self._conn.execute("PRAGMA freelist_count").fetchone()[0]

        def _size(p: Path) -> int:
            try:
                return p.stat().st_size
            except OSError:
                return 0

        return {
            "used": (count - free) * page,
            "free": free * page,
            "file": _size(self.path),
            "wal": _size(Path(f"{self.path}-wal")),
            "auto_vacuum": int(self._conn.execute("PRAGMA auto_vacuum").fetchone()[0]),
        }

    # -- row helpers -----------------------------------------------------------------------------

    def _row(self, row: Sequence[Any], table: str) -> dict[str, Any]:
        cols = [c[1] for c in self._conn.execute(f"PRAGMA table_info({table})").fetchall()]
        return dict(zip(cols, row))

    @staticmethod
    def _event(row: Sequence[Any]) -> dict[str, Any]:
        d = dict(zip(_EVENT_KEYS, row))
        d["fields"] = json.loads(d["fields"] or "{}")
        return d


def _split(script: str) -> list[str]:
    """A migration's statements. A ``;`` ends one only where SQLite agrees it is complete:
    a trigger's body has its own."""
    out: list[str] = []
    pending = ""
    for piece in script.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending.strip().rstrip(";").strip())
            pending = ""
    if pending.strip(" \n;"):
        out.append(pending.strip().rstrip(";").strip())
    return out


def _deep_merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(out[k], v)
        elif v is not None:
            out[k] = v
    return out


def monotonic() -> float:
    return time.monotonic()
