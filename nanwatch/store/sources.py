"""Followed files and their offsets (the ``sources`` table): load, save, rename, retire.

A source row is one generation of one file identity (dev, inode, generation) on this node; its
offset and stream context are written in the transaction that writes the events read before
them (ARCHITECTURE.md, invariant 2), so every writer here runs in the caller's transaction.
Rows of other nodes (a merged database) are history and never loaded for following.

:class:`SourceRuns` is what following files needs of the ``runs`` table: a run by id and the
cluster identity derived for it.
"""

from __future__ import annotations

from ..events import now_utc
from .db import Store
from .records import Run, Source, loads

_COLUMNS = (
    "id, run_id, path, root, dev, ino, gen, offset, head_hash, head_len, tail_hash, cutting, "
    "lines_cut, status, ctx"
)
# the statuses a restart follows again: active files, and generations that are twins for copies
_FOLLOWED = "('active', 'truncated', 'rotated')"


class Sources:
    """The ``sources`` rows of one store (this node's files). Reads go to the connection as
    they are (a damaged page surfaces as SQLite's error); writes through ``Store.execute``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def load(self) -> list[Source]:
        """Every source a restart follows again (active, or a twin for rotated copies)."""
        rows = self.store._conn.execute(
            f"SELECT {_COLUMNS} FROM sources WHERE status IN {_FOLLOWED} AND node = ''"
        ).fetchall()
        return [
            Source(
                id=int(r[0]),
                run_id=r[1],
                path=str(r[2]),
                root=str(r[3]),
                dev=int(r[4]),
                ino=int(r[5]),
                gen=int(r[6]),
                offset=int(r[7]),
                head_hash=r[8],
                head_len=int(r[9]),
                tail_hash=r[10],
                cutting=bool(r[11]),
                lines_cut=int(r[12]),
                status=str(r[13]),
                ctx=r[14],
            )
            for r in rows
        ]

    def save(self, src: Source) -> int:
        """Insert (``src.id`` None) or update one source with its offset; returns its id."""
        now = now_utc()
        if src.id is None:
            cur = self.store.execute(
                "INSERT INTO sources(run_id, path, root, dev, ino, gen, offset, head_hash, "
                "head_len, tail_hash, cutting, lines_cut, status, ctx, created_at, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) "
                "ON CONFLICT(dev, ino, gen, node) DO UPDATE SET path=excluded.path",
                (
                    src.run_id,
                    src.path,
                    src.root,
                    src.dev,
                    src.ino,
                    src.gen,
                    src.offset,
                    src.head_hash,
                    src.head_len,
                    src.tail_hash,
                    int(src.cutting),
                    src.lines_cut,
                    src.status,
                    src.ctx,
                    now,
                    now,
                ),
            )
            row = self.store._conn.execute(
                "SELECT id FROM sources WHERE dev=? AND ino=? AND gen=? AND node=''",
                (src.dev, src.ino, src.gen),
            ).fetchone()
            new_id = int(row[0]) if row else int(cur.lastrowid or 0)
            if row is not None:
                # the identity was stored before (a row the record did not know of): it takes
                # this offset, context and run
                self.store.execute(
                    "UPDATE sources SET offset=?, tail_hash=?, head_hash=?, head_len=?, "
                    "cutting=?, ctx=?, status=?, updated_at=?, run_id=? WHERE id=?",
                    (
                        src.offset,
                        src.tail_hash,
                        src.head_hash,
                        src.head_len,
                        int(src.cutting),
                        src.ctx,
                        src.status,
                        now,
                        src.run_id,
                        new_id,
                    ),
                )
            return new_id
        self.store.execute(
            "UPDATE sources SET path=?, offset=?, tail_hash=?, head_hash=?, head_len=?, cutting=?, "
            "lines_cut=?, ctx=?, status=?, updated_at=?, run_id=coalesce(?, run_id) WHERE id=?",
            (
                src.path,
                src.offset,
                src.tail_hash,
                src.head_hash,
                src.head_len,
                int(src.cutting),
                src.lines_cut,
                src.ctx,
                src.status,
                now,
                src.run_id,
                src.id,
            ),
        )
        return src.id

    def rename(self, source_id: int, path: str) -> None:
        """The file is followed under a new name (a rotation renamed it)."""
        self.store.execute("UPDATE sources SET path = ? WHERE id = ?", (path, source_id))

    def set_status(self, source_id: int, status: str) -> None:
        """Retire a source (rotated, truncated, gone, copied) or make it active again."""
        self.store.execute(
            "UPDATE sources SET status=?, updated_at=? WHERE id=?", (status, now_utc(), source_id)
        )

    def next_gen(self, dev: int, ino: int) -> int:
        """The next generation number for a file identity (inodes are reused)."""
        row = self.store._conn.execute(
            "SELECT max(gen) FROM sources WHERE dev = ? AND ino = ? AND node = ''", (dev, ino)
        ).fetchone()
        return 0 if row is None or row[0] is None else int(row[0]) + 1


class SourceRuns:
    """What following files needs of the ``runs`` table (created by ``Store.run_id``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, run_id: int) -> Run | None:
        row = self.store._conn.execute(
            "SELECT id, name, root, launch, experiment, job, node, created_at, first_time, "
            "last_time, facts, cluster_run FROM runs WHERE id = ?",
            (run_id,),
        ).fetchone()
        if row is None:
            return None
        return Run(
            id=int(row[0]),
            name=str(row[1]),
            root=str(row[2]),
            launch=str(row[3] or ""),
            experiment=row[4],
            job=row[5],
            node=row[6],
            created_at=str(row[7]),
            first_time=row[8],
            last_time=row[9],
            facts=loads(row[10], {}),
            cluster_run=row[11],
        )

    def set_identity(
        self, run_id: int, *, job: str | None, cluster_run: str | None, node: str
    ) -> None:
        """The run's cluster-wide names (``runs.job``, ``cluster_run``, ``node``)."""
        self.store.execute(
            "UPDATE runs SET job = ?, cluster_run = ?, node = ? WHERE id = ?",
            (job, cluster_run, node, run_id),
        )
