"""The fleet store: PostgreSQL, shared by every node of a job and by `nanwatch fleet`.

Each node keeps its SQLite database as its local truth and forwards what it committed: runs,
sources, events, its incidents' lifecycles and per-rank step-time summaries (not raw metrics).
Every forwarded row has an idempotent key, so retries, restarts and a fleet store that was down
for an hour still give every event exactly once:

- events: (node, source identity, offset, key), the source identity being the node's
  (dev, inode, generation) of the file (``run:<id>`` for an event no file holds);
- runs, sources and node incidents: (node, the node's own id); a node incident only moves
  forward (its version never goes back).

The node side keeps a high-water mark in its own ``meta`` (the last event id the fleet store
committed): the events table is the node's forwarding outbox, nothing is copied twice locally.
If the node dies between the fleet commit and its own, the next forward re-sends and the keys
drop the doubles.

``nanwatch fleet`` pulls new events into a working SQLite database (the same schema as a node's,
sources keyed by node as in ``nanwatch merge``), runs the same correlation code, and publishes
the fleet incidents back here as documents in the shape ``incidents --json``/``show --json``
print, so reads on the fleet store answer like reads on a node's file.

psycopg (v3) is imported lazily: only fleet mode needs it (``pip install 'nanwatch[fleet]'``).
Passwords never go in the DSN: ``password_file``, systemd's ``LoadCredential=fleet-password``,
``PGPASSWORD`` or ``~/.pgpass``; every message shows the DSN without a password.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse, urlunparse

from .._dc import dataclass
from ..errors import ConfigError, StoreError
from .db import Store
from .records import JSON, loads

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "LOCK_KEY",
    "FleetEvent",
    "FleetStore",
    "ForwardReport",
    "is_dsn",
    "safe_dsn",
    "waiting",
]

LOCK_KEY = 0x6E616E77  # "nanw": the advisory lock one `nanwatch fleet` holds while it works
FORWARD_BATCH = 2000
FORWARDED_UPTO = "fleet.forwarded_upto"
INCIDENTS_AT = "fleet.incidents_at"
SUMMARY_AT = "fleet.summary_at"
SUMMARY_BLOCK = "fleet.summary_block"

_SCHEMA: list[str] = [
    # 1: what nodes forward, and what the correlator publishes
    """
    CREATE TABLE nodes (
        node text PRIMARY KEY,
        host text,
        uid text,
        first_seen double precision NOT NULL,
        last_seen double precision NOT NULL,
        heartbeat double precision NOT NULL,
        events bigint NOT NULL DEFAULT 0
    );
    CREATE TABLE runs (
        id bigserial PRIMARY KEY,
        node text NOT NULL,
        src_id bigint NOT NULL,
        name text NOT NULL,
        root text NOT NULL,
        launch text NOT NULL,
        experiment text,
        job text,
        cluster_run text,
        created_at text NOT NULL,
        facts jsonb NOT NULL DEFAULT '{}',
        UNIQUE (node, src_id)
    );
    CREATE TABLE sources (
        id bigserial PRIMARY KEY,
        node text NOT NULL,
        src_id bigint NOT NULL,
        run_src bigint,
        path text NOT NULL,
        root text NOT NULL,
        dev bigint NOT NULL,
        ino bigint NOT NULL,
        gen integer NOT NULL,
        UNIQUE (node, src_id)
    );
    CREATE TABLE events (
        id bigserial PRIMARY KEY,
        node text NOT NULL,
        src_id bigint NOT NULL,
        source_key text NOT NULL,
        "offset" bigint NOT NULL,
        key text NOT NULL,
        kind text NOT NULL,
        time text,
        ingested_at text NOT NULL,
        run_src bigint,
        source_src bigint,
        line integer,
        rank integer,
        local_rank integer,
        host text,
        epoch integer,
        iter integer,
        step integer,
        stage text,
        device text,
        message text NOT NULL,
        fields jsonb NOT NULL DEFAULT '{}',
        src_incident bigint,
        UNIQUE (node, source_key, "offset", key)
    );
    CREATE INDEX events_kind ON events (kind, id);
    CREATE INDEX events_node ON events (node, id);
    CREATE TABLE node_incidents (
        node text NOT NULL,
        src_id bigint NOT NULL,
        run_src bigint,
        kind text NOT NULL,
        title text NOT NULL,
        status text NOT NULL,
        version integer NOT NULL,
        first_time text,
        last_time text,
        event_count integer NOT NULL,
        resolved_at text,
        updated_at text NOT NULL,
        PRIMARY KEY (node, src_id)
    );
    CREATE TABLE step_summaries (
        node text NOT NULL,
        run_src bigint NOT NULL,
        rank integer NOT NULL,
        n bigint NOT NULL,
        mean double precision,
        last_step bigint,
        last_time text,
        updated_at double precision NOT NULL,
        PRIMARY KEY (node, run_src, rank)
    );
    CREATE TABLE fleet_incidents (
        id bigint PRIMARY KEY,
        run text,
        kind text NOT NULL,
        status text NOT NULL,
        title text NOT NULL,
        first_time text,
        last_time text,
        version integer NOT NULL,
        doc jsonb NOT NULL,
        story jsonb NOT NULL,
        updated_at double precision NOT NULL
    );
    CREATE INDEX fleet_incidents_status ON fleet_incidents (status, id);
    CREATE TABLE fleet_members (
        node text NOT NULL,
        src_incident bigint NOT NULL,
        fleet_incident bigint NOT NULL,
        PRIMARY KEY (node, src_incident)
    );
    """,
]


def is_dsn(text: str | os.PathLike[str] | None) -> bool:
    """Whether a ``--db`` value names a PostgreSQL fleet store rather than a SQLite file."""
    return isinstance(text, str) and text.startswith(("postgresql://", "postgres://"))


def safe_dsn(dsn: str) -> str:
    """The DSN as messages may show it: never its password."""
    p = urlparse(dsn)
    if p.password is None:
        return dsn
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    user = f"{p.username}@" if p.username else ""
    return urlunparse(p._replace(netloc=f"{user}{host}"))


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:
        raise ConfigError(
            "fleet mode needs the PostgreSQL driver: pip install 'nanwatch[fleet]' (psycopg 3)"
        ) from None
    return psycopg


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """One forwarded event as the correlator pulls it, with its run, source and node."""

    id: int
    node: str
    src_id: int
    src_incident: int | None
    kind: str
    time: str | None
    ingested_at: str
    offset: int
    key: str
    line: int | None
    rank: int | None
    local_rank: int | None
    host: str | None
    epoch: int | None
    iter: int | None
    step: int | None
    stage: str | None
    device: str | None
    message: str
    fields: Mapping[str, JSON]
    run: Mapping[str, JSON] | None  # the node's run row (name, root, launch, job, ...)
    source: Mapping[str, JSON] | None  # path, root, dev, ino, gen


@dataclass
class ForwardReport:
    """What one forward did; ``error`` set (and nothing lost) when the fleet was unreachable."""

    events: int = 0  # events the fleet store committed (doubles of a retry not counted)
    sent: int = 0  # events sent, doubles included
    runs: int = 0
    incidents: int = 0
    summaries: int = 0
    waiting: int = 0  # events still to forward
    error: str | None = None
    batches: list[int] = field(default_factory=list)


class FleetStore:
    """One connection to the fleet store. Methods commit their own transaction."""

    def __init__(self, conn: psycopg.Connection[Any], dsn: str) -> None:
        self._conn = conn
        self.dsn = safe_dsn(dsn)

    # -- connecting ----------------------------------------------------------------------------

    @classmethod
    def connect(
        cls, dsn: str, *, password: str | None = None, timeout: float = 5.0, migrate: bool = True
    ) -> FleetStore:
        """Connect (StoreError naming the DSN without its password) and bring the schema up."""
        if urlparse(dsn).password is not None:
            raise ConfigError(
                f"{safe_dsn(dsn)}: the DSN holds a password; remove it and use PGPASSWORD, "
                "~/.pgpass, or the config's [fleet] password_file"
            )
        pg = _driver()
        kw: dict[str, Any] = {"connect_timeout": max(1, int(timeout)), "autocommit": False}
        if password:
            kw["password"] = password
        try:
            conn = pg.connect(dsn, **kw)
        except pg.Error as e:
            raise StoreError(f"{safe_dsn(dsn)}: cannot reach the fleet store ({_why(e)})") from None
        store = cls(conn, dsn)
        if migrate:
            store._migrate()
        return store

    def close(self) -> None:
        try:
            self._conn.close()
        except Exception:  # closing a broken connection: nothing left to lose
            pass

    def __enter__(self) -> FleetStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        pg = _driver()
        try:
            with self._conn.transaction(), self._conn.cursor() as cur:
                yield cur
        except pg.Error as e:
            raise StoreError(f"{self.dsn}: the fleet store failed ({_why(e)})") from None

    def _migrate(self) -> None:
        with self._tx() as cur:
            # one migrator at a time: two correlators and a node may start together
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY + 1,))
            cur.execute("CREATE TABLE IF NOT EXISTS fleet_meta (key text PRIMARY KEY, value text)")
            cur.execute("SELECT value FROM fleet_meta WHERE key = 'schema_version'")
            row = cur.fetchone()
            have = int(row[0]) if row else 0
            for n, script in enumerate(_SCHEMA[have:], start=have + 1):
                cur.execute(script)
                cur.execute(
                    "INSERT INTO fleet_meta(key, value) VALUES ('schema_version', %s) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (str(n),),
                )

    # -- the correlator's lock -----------------------------------------------------------------

    def try_lock(self) -> bool:
        """Take the correlator's session lock; False while another instance holds it."""
        with self._tx() as cur:
            cur.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))
            row = cur.fetchone()
        return bool(row and row[0])

    def unlock(self) -> None:
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,))

    # -- node side: forwarding -----------------------------------------------------------------

    def forward(
        self,
        local: Store,
        *,
        node: str,
        host: str | None,
        now: float,
        heartbeat: float,
        max_batches: int = 50,
        batch: int = FORWARD_BATCH,
    ) -> ForwardReport:
        """Send what ``local`` committed since the last forward; exactly once on the fleet side."""
        report = ForwardReport()
        uid = local.meta_get("uid")
        for _ in range(max_batches):
            upto = int(local.meta_get(FORWARDED_UPTO, "0") or 0)
            rows = _local_events(local, upto, batch)
            if not rows:
                break
            run_ids = {r[14] for r in rows if r[14] is not None}
            source_ids = {r[15] for r in rows if r[15] is not None}
            with self._tx() as cur:
                report.runs += _put_runs(cur, local, node, run_ids)
                _put_sources(cur, local, node, source_ids)
                added = _copy_events(cur, [_event_params(node, r) for r in rows])
                _beat(cur, node, host, uid, now, heartbeat, added)
            report.sent += len(rows)
            report.events += added
            report.batches.append(len(rows))
            with local.transaction():
                local.meta_set(FORWARDED_UPTO, str(rows[-1][0]))
        report.incidents = self._forward_incidents(local, node)
        last_summary = float(local.meta_get(SUMMARY_AT, "0") or 0)
        if now - last_summary >= heartbeat or now < last_summary:
            report.summaries = self._forward_summaries(local, node, now)
            with local.transaction():
                local.meta_set(SUMMARY_AT, repr(now))
        with self._tx() as cur:
            _beat(cur, node, host, uid, now, heartbeat, 0)
        report.waiting = waiting(local)
        return report

    def _forward_incidents(self, local: Store, node: str) -> int:
        since = local.meta_get(INCIDENTS_AT, "") or ""
        rows = local._conn.execute(
            "SELECT id, run_id, kind, title, status, version, first_time, last_time, event_count, "
            "resolved_at, updated_at FROM incidents WHERE updated_at >= ? ORDER BY updated_at",
            (since,),
        ).fetchall()
        if not rows:
            return 0
        with self._tx() as cur:
            cur.executemany(
                "INSERT INTO node_incidents(node, src_id, run_src, kind, title, status, version, "
                "first_time, last_time, event_count, resolved_at, updated_at) VALUES "
                "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (node, src_id) DO UPDATE SET "
                "kind = excluded.kind, title = excluded.title, status = excluded.status, "
                "version = excluded.version, first_time = excluded.first_time, "
                "last_time = excluded.last_time, event_count = excluded.event_count, "
                "resolved_at = excluded.resolved_at, updated_at = excluded.updated_at "
                "WHERE node_incidents.version <= excluded.version",
                [(node, *r) for r in rows],
            )
        with local.transaction():
            local.meta_set(INCIDENTS_AT, str(rows[-1][10]))
        return len(rows)

    def _forward_summaries(self, local: Store, node: str, now: float) -> int:
        """Per-rank step-time summaries (count, mean, last step) of the runs that logged
        iterations since the last summary: a few rows per rank, never the raw metrics."""
        from .metrics import MISSING, Metrics

        metrics = Metrics(local)
        since = int(local.meta_get(SUMMARY_BLOCK, "0") or 0)
        newest = metrics.last_block()
        if newest <= since:
            return 0
        rows = []
        for run_id in sorted(metrics.runs_after(since)):
            times = metrics.step_times(run_id)
            per: dict[int, list[float]] = {}
            last: dict[int, int] = {}
            for rank, step, sec in zip(times.rank, times.step, times.seconds):
                if rank == MISSING:
                    continue
                per.setdefault(rank, []).append(sec)
                last[rank] = max(last.get(rank, step), step)
            for rank, secs in per.items():
                rows.append(
                    (node, run_id, rank, len(secs), sum(secs) / len(secs), last[rank], None, now)
                )
        if rows:
            with self._tx() as cur:
                cur.executemany(
                    "INSERT INTO step_summaries(node, run_src, rank, n, mean, last_step, "
                    "last_time, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s) "
                    "ON CONFLICT (node, run_src, rank) DO UPDATE SET n = excluded.n, "
                    "mean = excluded.mean, last_step = excluded.last_step, "
                    "last_time = excluded.last_time, updated_at = excluded.updated_at",
                    rows,
                )
        with local.transaction():
            local.meta_set(SUMMARY_BLOCK, str(newest))
        return len(rows)

    # -- correlator side -----------------------------------------------------------------------

    def events_after(self, last_id: int, limit: int = 20000) -> list[FleetEvent]:
        with self._tx() as cur:
            cur.execute(
                "SELECT e.id, e.node, e.src_id, e.src_incident, e.kind, e.time, e.ingested_at, "
                'e."offset", e.key, e.line, e.rank, e.local_rank, e.host, e.epoch, e.iter, '
                "e.step, e.stage, e.device, e.message, e.fields, "
                "r.src_id, r.name, r.root, r.launch, r.experiment, r.job, r.cluster_run, "
                "r.created_at, r.facts, s.src_id, s.path, s.root, s.dev, s.ino, s.gen "
                "FROM events e "
                "LEFT JOIN runs r ON r.node = e.node AND r.src_id = e.run_src "
                "LEFT JOIN sources s ON s.node = e.node AND s.src_id = e.source_src "
                "WHERE e.id > %s ORDER BY e.id LIMIT %s",
                (last_id, limit),
            )
            rows = cur.fetchall()
        out = []
        for r in rows:
            run = None
            if r[20] is not None:
                run = dict(
                    zip(
                        ("src_id", "name", "root", "launch", "experiment", "job", "cluster_run",
                         "created_at", "facts"),
                        r[20:29],
                    )
                )  # fmt: skip
            source = None
            if r[29] is not None:
                source = dict(zip(("src_id", "path", "root", "dev", "ino", "gen"), r[29:35]))
            out.append(
                FleetEvent(
                    id=r[0], node=r[1], src_id=r[2], src_incident=r[3], kind=r[4], time=r[5],
                    ingested_at=r[6], offset=r[7], key=r[8], line=r[9], rank=r[10],
                    local_rank=r[11], host=r[12], epoch=r[13], iter=r[14], step=r[15],
                    stage=r[16], device=r[17], message=r[18], fields=r[19] or {}, run=run,
                    source=source,
                )
            )  # fmt: skip
        return out

    def node_incidents(self) -> list[tuple[str, int, str, str | None]]:
        """(node, node incident id, status, resolved_at) of every forwarded node incident."""
        with self._tx() as cur:
            cur.execute("SELECT node, src_id, status, resolved_at FROM node_incidents")
            return [(str(a), int(b), str(c), d) for a, b, c, d in cur.fetchall()]

    def hosts(self) -> dict[str, str]:
        """node -> the host its daemon forwards from."""
        with self._tx() as cur:
            cur.execute("SELECT node, host FROM nodes WHERE host IS NOT NULL")
            return {str(a): str(b) for a, b in cur.fetchall()}

    def nodes(self) -> list[tuple[str, str | None, float, float, int]]:
        """(node, host, last_seen, heartbeat, events) of every node that ever forwarded."""
        with self._tx() as cur:
            cur.execute("SELECT node, host, last_seen, heartbeat, events FROM nodes ORDER BY node")
            return [(str(a), b, float(c), float(d), int(e)) for a, b, c, d, e in cur.fetchall()]

    def publish(
        self,
        docs: Sequence[tuple[Mapping[str, JSON], Mapping[str, JSON]]],
        members: Sequence[tuple[str, int, int]],
        *,
        now: float,
    ) -> None:
        """Fleet incidents (``incidents --json`` document, ``show --json`` story) and which node
        incidents each absorbed; one transaction, so readers never see half a decision."""
        pg = _driver()
        jsonb = pg.types.json.Jsonb
        with self._tx() as cur:
            cur.executemany(
                "INSERT INTO fleet_incidents(id, run, kind, status, title, first_time, last_time, "
                "version, doc, story, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) "
                "ON CONFLICT (id) DO UPDATE SET run = excluded.run, kind = excluded.kind, "
                "status = excluded.status, title = excluded.title, "
                "first_time = excluded.first_time, last_time = excluded.last_time, "
                "version = excluded.version, doc = excluded.doc, story = excluded.story, "
                "updated_at = excluded.updated_at",
                [
                    (
                        doc["id"], doc.get("run"), doc["kind"], doc["status"], doc["title"],
                        doc.get("first_time"), doc.get("last_time"), doc.get("version", 1),
                        jsonb(doc), jsonb(story), now,
                    )
                    for doc, story in docs
                ],
            )  # fmt: skip
            cur.executemany(
                "INSERT INTO fleet_members(node, src_incident, fleet_incident) VALUES (%s,%s,%s) "
                "ON CONFLICT (node, src_incident) DO UPDATE SET "
                "fleet_incident = excluded.fleet_incident",
                list(members),
            )

    # -- reads (incidents, show, events, runs on --db postgresql://) ---------------------------

    def incidents(
        self, *, open_only: bool = False, include_merged: bool = False, kind: str | None = None,
        run: str | None = None, limit: int | None = None,
    ) -> list[dict[str, JSON]]:  # fmt: skip
        where, params = ["TRUE"], []
        if not include_merged:
            where.append("status != 'merged'")
        if open_only:
            where.append("status = 'open'")
        if kind:
            where.append("kind = %s")
            params.append(kind)
        if run:
            where.append("run = %s")
            params.append(run)
        sql = f"SELECT doc FROM fleet_incidents WHERE {' AND '.join(where)} ORDER BY id"
        with self._tx() as cur:
            cur.execute(sql, params)
            docs = [dict(r[0]) for r in cur.fetchall()]
        return docs[-limit:] if limit else docs

    def story(self, incident_id: int) -> dict[str, JSON] | None:
        with self._tx() as cur:
            cur.execute("SELECT story FROM fleet_incidents WHERE id = %s", (incident_id,))
            row = cur.fetchone()
        return dict(row[0]) if row else None

    def members(self, incident_id: int) -> list[tuple[str, int]]:
        with self._tx() as cur:
            cur.execute(
                "SELECT node, src_incident FROM fleet_members WHERE fleet_incident = %s "
                "ORDER BY node, src_incident",
                (incident_id,),
            )
            return [(str(a), int(b)) for a, b in cur.fetchall()]

    def events(
        self, *, kind: str | None = None, node: str | None = None, limit: int | None = None
    ) -> list[dict[str, JSON]]:
        where, params = ["TRUE"], []
        if kind:
            where.append("e.kind = %s")
            params.append(kind)
        if node:
            where.append("e.node = %s")
            params.append(node)
        sql = (
            # host: the machine the node's daemon forwarded from
            "SELECT e.id, e.kind, e.time, e.node, coalesce(n.host, e.host), e.rank, e.local_rank, "
            "e.epoch, e.iter, e.step, e.stage, e.device, e.message, e.fields, r.name, s.path, "
            "e.line FROM events e LEFT JOIN runs r ON r.node = e.node AND r.src_id = e.run_src "
            "LEFT JOIN sources s ON s.node = e.node AND s.src_id = e.source_src "
            "LEFT JOIN nodes n ON n.node = e.node "
            f"WHERE {' AND '.join(where)} ORDER BY e.id"
        )
        keys = ("id", "kind", "time", "node", "host", "rank", "local_rank", "epoch", "iter",
                "step", "stage", "device", "message", "fields", "run", "file", "line")  # fmt: skip
        with self._tx() as cur:
            cur.execute(sql, params)
            rows = [dict(zip(keys, r)) for r in cur.fetchall()]
        return rows[-limit:] if limit else rows

    def runs(self) -> list[dict[str, JSON]]:
        with self._tx() as cur:
            cur.execute(
                "SELECT r.node, r.name, r.job, r.cluster_run, r.created_at, "
                "(SELECT count(*) FROM events e WHERE e.node = r.node AND e.run_src = r.src_id) "
                "FROM runs r ORDER BY r.created_at, r.node"
            )
            keys = ("node", "name", "job", "run", "created_at", "events")
            return [dict(zip(keys, r)) for r in cur.fetchall()]

    def count_events(self) -> int:
        with self._tx() as cur:
            return _count(cur, "events", ())


# -- helpers (the node's SQLite side) ---------------------------------------------------------


def waiting(local: Store) -> int:
    """Events this node committed that the fleet store has not confirmed yet."""
    upto = int(local.meta_get(FORWARDED_UPTO, "0") or 0)
    row = local._conn.execute("SELECT count(*) FROM events WHERE id > ?", (upto,)).fetchone()
    return int(row[0])


def _local_events(local: Store, upto: int, batch: int) -> list[tuple[Any, ...]]:
    return list(
        local._conn.execute(
            "SELECT e.id, e.kind, e.time, e.ingested_at, e.offset, e.key, e.line, e.rank, "
            "e.local_rank, e.node, e.epoch, e.iter, e.step, e.stage, e.run_id, e.source_id, "
            "e.device, e.message, e.fields, e.incident_id, s.dev, s.ino, s.gen "
            "FROM events e LEFT JOIN sources s ON s.id = e.source_id "
            "WHERE e.id > ? ORDER BY e.id LIMIT ?",
            (upto, batch),
        ).fetchall()
    )


_EVENT_COPY = (
    'node, src_id, source_key, "offset", key, kind, time, ingested_at, run_src, source_src, '
    "line, rank, local_rank, host, epoch, iter, step, stage, device, message, fields, "
    "src_incident"
)


def _copy_events(cur: Any, params: list[tuple[Any, ...]]) -> int:
    """COPY into a scratch table, then one INSERT that drops the doubles: the count it returns
    is what the fleet store did not have (a retried batch adds 0)."""
    cur.execute(
        "CREATE TEMP TABLE IF NOT EXISTS forwarded ON COMMIT DELETE ROWS AS "
        f"SELECT {_EVENT_COPY} FROM events WITH NO DATA"
    )
    with cur.copy(f"COPY forwarded ({_EVENT_COPY}) FROM STDIN") as copy:
        for row in params:
            copy.write_row(row)
    cur.execute(
        f"INSERT INTO events ({_EVENT_COPY}) SELECT {_EVENT_COPY} FROM forwarded "
        'ON CONFLICT (node, source_key, "offset", key) DO NOTHING'
    )
    return max(0, int(cur.rowcount))


def _event_params(node: str, r: Sequence[Any]) -> tuple[Any, ...]:
    (eid, kind, time, ingested, offset, key, line, rank, local_rank, host, epoch, iter_, step,
     stage, run_id, source_id, device, message, fields, incident, dev, ino, gen) = r  # fmt: skip
    source_key = f"{dev}:{ino}:{gen}" if dev is not None else f"run:{run_id}"
    return (
        node, eid, source_key, offset, key, kind, time, ingested, run_id, source_id, line, rank,
        local_rank, host, epoch, iter_, step, stage, device, message, fields or "{}", incident,
    )  # fmt: skip


def _put_runs(cur: Any, local: Store, node: str, run_ids: set[int]) -> int:
    if not run_ids:
        return 0
    marks = ",".join("?" * len(run_ids))
    rows = local._conn.execute(
        "SELECT id, name, root, launch, experiment, job, cluster_run, created_at, facts "
        f"FROM runs WHERE id IN ({marks})",
        sorted(run_ids),
    ).fetchall()
    jsonb = _driver().types.json.Jsonb
    cur.executemany(
        "INSERT INTO runs(node, src_id, name, root, launch, experiment, job, cluster_run, "
        "created_at, facts) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) "
        "ON CONFLICT (node, src_id) DO UPDATE SET name = excluded.name, job = excluded.job, "
        "cluster_run = excluded.cluster_run, facts = excluded.facts",
        [(node, *r[:8], jsonb(loads(r[8], {}))) for r in rows],
    )
    return len(rows)


def _put_sources(cur: Any, local: Store, node: str, source_ids: set[int]) -> None:
    if not source_ids:
        return
    marks = ",".join("?" * len(source_ids))
    rows = local._conn.execute(
        f"SELECT id, run_id, path, root, dev, ino, gen FROM sources WHERE id IN ({marks})",
        sorted(source_ids),
    ).fetchall()
    cur.executemany(
        "INSERT INTO sources(node, src_id, run_src, path, root, dev, ino, gen) "
        "VALUES (%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (node, src_id) DO UPDATE SET "
        "path = excluded.path, run_src = excluded.run_src",
        [(node, *r) for r in rows],
    )


def _beat(
    cur: Any, node: str, host: str | None, uid: str | None, now: float, every: float, added: int
) -> None:
    cur.execute(
        "INSERT INTO nodes(node, host, uid, first_seen, last_seen, heartbeat, events) "
        "VALUES (%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (node) DO UPDATE SET host = excluded.host, "
        "uid = excluded.uid, last_seen = greatest(nodes.last_seen, excluded.last_seen), "
        "heartbeat = excluded.heartbeat, events = nodes.events + excluded.events",
        (node, host, uid, now, now, every, added),
    )


def _count(cur: Any, what: str, params: Sequence[Any]) -> int:
    cur.execute(f"SELECT count(*) FROM {what}", params)
    row = cur.fetchone()
    return int(row[0]) if row else 0


def _why(e: BaseException) -> str:
    """A driver error in one line, without anything the DSN held."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text
