"""The SQLite store: one writer connection (WAL), numbered migrations, typed helpers.

``PRAGMA synchronous=NORMAL`` in WAL mode is chosen on purpose: a process crash (kill -9)
loses nothing that was committed, and a power loss can only lose the last transactions
*together with their offsets*, so the next start re-reads those bytes and re-creates exactly
the same event rows (invariants 1 and 2). FULL would add an fsync per commit for no gain.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlite_utils

from ..errors import StoreError
from ..events import Event, Metric, now_utc
from .schema import MIGRATIONS

SCHEMA_VERSION = len(MIGRATIONS)

EVENT_COLUMNS = (
    "id, kind, time, ingested_at, run_id, source_id, offset, key, line, rank, local_rank, node, "
    "epoch, iter, step, stage, device, message, fields, incident_id"
)


def _explain(path: Path, e: sqlite3.Error) -> StoreError:
    msg = str(e)
    if "not a database" in msg or "malformed" in msg:
        return StoreError(
            f"{path}: the database is damaged ({msg}). Recovery: stop nanwatch, move the file "
            f"aside (mv {path} {path}.bad), then either start afresh (offsets restart, logs are "
            f"read again) or salvage it with: sqlite3 {path}.bad .recover | sqlite3 {path}"
        )
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
    """One writing process per database: ``<db>.lock`` held with flock while it writes."""

    def __init__(self, db_path: Path) -> None:
        self.path = Path(str(db_path) + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise StoreError(f"{self.path}: cannot create the lock file ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise StoreError(
                f"{self.path.with_suffix('')}: another nanwatch process (pid {holder}) is "
                "writing this database; stop it, or pass another --db"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Store:
    """Owns one connection. The writer thread uses it for every write (invariant 5)."""

    def __init__(self, path: Path, conn: sqlite3.Connection, *, readonly: bool) -> None:
        self.path = path
        self.conn = conn
        self.readonly = readonly
        self.db = sqlite_utils.Database(conn)
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
        if readonly:
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
            except sqlite3.Error as e:
                raise _explain(p, e) from None
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
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"{p.parent}: cannot create the database folder ({e.strerror})"
            ) from None
        lock = WriterLock(p)
        if exclusive:
            lock.acquire()
        try:
            conn = sqlite3.connect(
                str(p), isolation_level=None, timeout=5.0, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=OFF")
            conn.execute("PRAGMA busy_timeout=5000")
            store = cls(p, conn, readonly=False)
            store.lock = lock
            store._migrate()
        except sqlite3.Error as e:
            lock.release()
            raise _explain(p, e) from None
        except BaseException:
            lock.release()
            raise
        return store

    def _migrate(self) -> None:
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: written by a newer nanwatch (schema {version} > {SCHEMA_VERSION}); "
                "upgrade nanwatch"
            )
        if version == 0:
            # a fresh file: auto_vacuum must be set before the first table exists
            self.conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        for number in range(version, SCHEMA_VERSION):
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _split(MIGRATIONS[number]):
                    self.conn.execute(statement)
                self.conn.execute(f"PRAGMA user_version={number + 1}")
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        try:
            if not self.readonly:
                self.conn.execute("PRAGMA optimize")
        except sqlite3.Error:
            pass
        self.conn.close()
        if self.lock is not None:
            self.lock.release()

    # -- transactions ----------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._in_tx:
            yield
            return
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as e:
            raise _explain(self.path, e) from None
        self._in_tx = True
        try:
            yield
        except BaseException as e:
            self._in_tx = False
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(e, sqlite3.Error):
                raise _explain(self.path, e) from None
            raise
        self._in_tx = False
        try:
            self.conn.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise _explain(self.path, e) from None

    def execute(self, sql: str, params: Sequence[Any] | Mapping[str, Any] = ()) -> sqlite3.Cursor:
        try:
            return self.conn.execute(sql, params)
        except sqlite3.Error as e:
            raise _explain(self.path, e) from None

    # -- meta ------------------------------------------------------------------------------------

    def meta_get(self, key: str, default: str | None = None) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
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
        row = self.conn.execute(
            "SELECT id FROM runs WHERE root=? AND launch=?", (root, launch)
        ).fetchone()
        if row:
            return int(row[0])
        base, n = name, 1
        with self.transaction():
            while self.conn.execute("SELECT 1 FROM runs WHERE name=?", (name,)).fetchone():
                n += 1
                name = f"{base}~{n}"
            cur = self.execute(
                "INSERT INTO runs(name, root, launch, experiment, node, job, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (name, root, launch, experiment, node, job, now_utc()),
            )
        return int(cur.lastrowid or 0)

    def run_by_name(self, name: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT * FROM runs WHERE name=?", (name,)).fetchone()
        return self._row(row, "runs") if row else None

    def update_run_facts(self, run_id: int, facts: Mapping[str, Any]) -> None:
        row = self.conn.execute("SELECT facts FROM runs WHERE id=?", (run_id,)).fetchone()
        current = json.loads(row[0]) if row and row[0] else {}
        merged = _deep_merge(current, facts)
        self.execute("UPDATE runs SET facts=? WHERE id=?", (json.dumps(merged), run_id))

    # -- sources ---------------------------------------------------------------------------------

    def load_sources(self) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT * FROM sources WHERE status IN ('active', 'truncated', 'rotated')"
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
                "ON CONFLICT(dev, ino, gen) DO UPDATE SET path=excluded.path",
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
            row = self.conn.execute(
                "SELECT id FROM sources WHERE dev=? AND ino=? AND gen=?",
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
        row = self.conn.execute(
            "SELECT max(gen) FROM sources WHERE dev = ? AND ino = ?", (dev, ino)
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
        before = self.conn.total_changes
        self.conn.executemany(
            "INSERT OR IGNORE INTO events(kind, time, ingested_at, run_id, source_id, offset, key, "
            "line, rank, local_rank, node, epoch, iter, step, stage, device, message, fields) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        return self.conn.total_changes - before

    def insert_metrics(
        self, run_id: int | None, source_id: int | None, metrics: Iterable[Metric]
    ) -> int:
        rows = [
            (
                run_id,
                source_id,
                m.offset,
                m.rank,
                m.step,
                m.epoch,
                m.iter,
                m.stage,
                m.time,
                m.loss,
                m.grad_norm,
                m.step_time,
                m.data_time,
                m.lr,
                m.memory,
            )
            for m in metrics
        ]
        if not rows:
            return 0
        before = self.conn.total_changes
        self.conn.executemany(
            "INSERT OR IGNORE INTO metrics(run_id, source_id, offset, rank, step, epoch, iter, "
            "stage, time, loss, grad_norm, step_time, data_time, lr, memory) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        return self.conn.total_changes - before

    def max_event_id(self) -> int:
        row = self.conn.execute("SELECT max(id) FROM events").fetchone()
        return int(row[0] or 0)

    def events_after(self, last_id: int, limit: int = 100000) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE id > ? ORDER BY id LIMIT ?", (last_id, limit)
        ).fetchall()
        return [self._event(r) for r in rows]

    # -- row helpers -----------------------------------------------------------------------------

    def _row(self, row: Sequence[Any], table: str) -> dict[str, Any]:
        cols = [c[1] for c in self.conn.execute(f"PRAGMA table_info({table})").fetchall()]
        return dict(zip(cols, row))

    @staticmethod
    def _event(row: Sequence[Any]) -> dict[str, Any]:
        cols = [c.strip() for c in EVENT_COLUMNS.split(",")]
        d = dict(zip(cols, row))
        d["fields"] = json.loads(d["fields"] or "{}")
        return d


def _split(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


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
