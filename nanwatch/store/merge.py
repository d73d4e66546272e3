"""Fleet history: node databases merged into one (`nanwatch merge OUT.db NODE.db...`).

Every node keeps its own SQLite as the local truth; merging copies what each one read into a
fleet database, so `incidents` and `show` answer across nodes.

- **Runs of one launch become one run.** A node run with a cluster-wide identity (``runs.job``
  and ``cluster_run``, see ``sources/identity.py``) joins the fleet run of the same job and run,
  whatever node it came from; a run that only has a local name stays its node's own
  (``name@node``). Facts are merged.
- **Node identity is kept.** Sources carry their node (file identity is per node: inodes of two
  nodes collide), events keep theirs, ``runs.node`` is the node of a single-node run (NULL when
  several nodes fed it).
- **Idempotent.** A database is named by its ``meta`` uid; the events and metric blocks merged
  from it are remembered (``merge_events``, ``merge_origins.metrics_upto``: block ids only
  grow), so merging the same database again adds only what it gained since (and a block read
  twice keeps only the iterations the fleet database lacks: ``store/metric_writer.py``).
- **Incidents are correlated again** by the caller (the correlator reads the merged events as
  if one node had read them all, so an OOM on node A absorbs node B's timeouts), and each
  node's lifecycle carries over: a fleet incident is resolved once every node incident its
  events came from is resolved (:func:`carry_over_resolutions`).

Derived slowdown events are not copied: the fleet correlator finds slowdowns again from the
merged step times (medians over every rank of the launch).
"""

from __future__ import annotations

import json
from dataclasses import field
from pathlib import Path
from typing import Any

from .._dc import dataclass
from ..errors import StoreError
from ..events import now_utc
from .db import Store
from .metrics import Metrics

BATCH = 5000

_EVENT_COLS = (
    "kind, time, ingested_at, run_id, source_id, offset, key, line, rank, local_rank, node, "
    "epoch, iter, step, stage, device, message, fields"
)


@dataclass
class MergeReport:
    path: str
    origin: str
    nodes: list[str] = field(default_factory=list)
    runs: int = 0
    sources: int = 0
    events: int = 0  # new event rows in the fleet database
    metrics: int = 0


def merge_database(out: Store, src: Store, *, path: str) -> MergeReport:
    """Copy what ``src`` (a node database, read-only) holds and ``out`` lacks; one transaction."""
    origin = src.meta_get("uid")
    if not origin:
        raise StoreError(f"{path}: the database has no uid; open it once with nanwatch to add one")
    if origin == out.meta_get("uid"):
        raise StoreError(f"{path}: this is the output database itself; name another one")
    fallback_node = Path(path).stem
    report = MergeReport(path=path, origin=origin)
    # one read transaction: a node database still being written stays consistent (WAL)
    src._conn.execute("BEGIN")
    try:
        with out.transaction():
            runs, run_nodes = _runs(out, src, fallback_node, report)
            sources = _sources(out, src, runs, run_nodes, fallback_node, report)
            _events(out, src, origin, runs, sources, run_nodes, fallback_node, report)
            _metrics(out, src, origin, runs, sources, report)
            _incidents(out, src, origin)
            now = now_utc()
            out.execute(
                "INSERT INTO merge_origins(origin, node, path, first_merged_at, last_merged_at, "
                "events) VALUES (?,?,?,?,?,?) ON CONFLICT(origin) DO UPDATE SET "
                "node = excluded.node, path = excluded.path, "
                "last_merged_at = excluded.last_merged_at, events = events + excluded.events",
                (origin, ",".join(report.nodes) or None, path, now, now, report.events),
            )
    finally:
        src._conn.execute("COMMIT")
    return report


def _runs(
    out: Store, src: Store, fallback_node: str, report: MergeReport
) -> tuple[dict[int, int], dict[int, str]]:
    mapping: dict[int, int] = {}
    nodes: dict[int, str] = {}
    rows = src._conn.execute(
        "SELECT id, name, root, launch, experiment, job, cluster_run, node, created_at, facts "
        "FROM runs ORDER BY id"
    ).fetchall()
    for rid, name, root, launch, experiment, job, crun, node, created, facts in rows:
        node = node or fallback_node
        nodes[rid] = node
        if job:
            # one launch seen by several nodes: one run (see the module docstring)
            key_root, key_launch, fleet_name = f"cluster:{job}", crun or job, name
        else:
            key_root, key_launch, fleet_name = f"node:{node}:{root}", launch, f"{name}@{node}"
        dst = out.run_id(
            key_root, key_launch, fleet_name, experiment=experiment, node=node, job=job
        )
        out.execute(
            "UPDATE runs SET cluster_run = coalesce(cluster_run, ?), "
            "node = CASE WHEN node IS ? THEN node ELSE NULL END, "
            "created_at = min(created_at, ?) WHERE id = ?",
            (crun if job else None, node, created, dst),
        )
        if facts and facts != "{}":
            out.update_run_facts(dst, json.loads(facts))
        mapping[rid] = dst
        if node not in report.nodes:
            report.nodes.append(node)
    report.runs = len(set(mapping.values()))
    return mapping, nodes


def _sources(
    out: Store,
    src: Store,
    runs: dict[int, int],
    run_nodes: dict[int, str],
    fallback_node: str,
    report: MergeReport,
) -> dict[int, int]:
    mapping: dict[int, int] = {}
    rows = src._conn.execute(
        "SELECT id, run_id, path, root, dev, ino, gen, offset, head_hash, head_len, tail_hash, "
        "lines_cut, status, created_at, updated_at, node FROM sources ORDER BY id"
    ).fetchall()
    for (sid, run_id, path, root, dev, ino, gen, offset, head_hash, head_len, tail_hash,
         lines_cut, status, created, updated, node) in rows:  # fmt: skip
        # '' is the node database's own node; a merged database's rows keep theirs
        node = node or run_nodes.get(run_id) or fallback_node
        out.execute(
            "INSERT INTO sources(run_id, path, root, dev, ino, gen, offset, head_hash, head_len, "
            "tail_hash, lines_cut, status, ctx, created_at, updated_at, node) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,NULL,?,?,?) "
            "ON CONFLICT(dev, ino, gen, node) DO UPDATE SET path = excluded.path, "
            "offset = max(offset, excluded.offset), status = excluded.status, "
            "updated_at = excluded.updated_at, run_id = excluded.run_id",
            (runs.get(run_id), path, root, dev, ino, gen, offset, head_hash, head_len,
             tail_hash, lines_cut, status, created, updated, node),
        )  # fmt: skip
        row = out._conn.execute(
            "SELECT id FROM sources WHERE dev = ? AND ino = ? AND gen = ? AND node = ?",
            (dev, ino, gen, node),
        ).fetchone()
        mapping[sid] = int(row[0])
    report.sources = len(mapping)
    return mapping


def _events(
    out: Store,
    src: Store,
    origin: str,
    runs: dict[int, int],
    sources: dict[int, int],
    run_nodes: dict[int, str],
    fallback_node: str,
    report: MergeReport,
) -> None:
    last = out._conn.execute(
        "SELECT coalesce(max(src_id), 0) FROM merge_events WHERE origin = ?", (origin,)
    ).fetchone()[0]
    cur = src._conn.execute(
        f"SELECT id, incident_id, {_EVENT_COLS} FROM events WHERE id > ? ORDER BY id", (last,)
    )
    while True:
        rows = cur.fetchmany(BATCH)
        if not rows:
            return
        base = int(out._conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0])
        batch: list[tuple[Any, ...]] = []
        links: list[tuple[int, str, int, Any]] = []
        for src_id, incident, *cols in rows:
            kind, key, run_id, source_id, node = cols[0], cols[6], cols[3], cols[4], cols[10]
            if kind == "slowdown" and key == "slowdown":
                continue  # derived from step times: the fleet correlator derives its own
            dst = base + len(batch) + 1
            cols[3] = runs.get(run_id)
            cols[4] = sources.get(source_id)
            cols[10] = node or run_nodes.get(run_id) or fallback_node
            batch.append((dst, *cols))
            links.append((dst, origin, src_id, incident))
        if not batch:
            continue
        out._conn.executemany(
            f"INSERT OR IGNORE INTO events(id, {_EVENT_COLS}) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            batch,
        )
        # a row already here under another origin (the same node via a merged database too)
        # was ignored: only the rows that went in are linked to this origin
        kept = {r[0] for r in out._conn.execute("SELECT id FROM events WHERE id > ?", (base,))}
        out._conn.executemany(
            "INSERT OR IGNORE INTO merge_events(event_id, origin, src_id, src_incident) "
            "VALUES (?,?,?,?)",
            [link for link in links if link[0] in kept],
        )
        report.events += len(kept)


def _metrics(
    out: Store,
    src: Store,
    origin: str,
    runs: dict[int, int],
    sources: dict[int, int],
    report: MergeReport,
) -> None:
    row = out._conn.execute(
        "SELECT metrics_upto FROM merge_origins WHERE origin = ?", (origin,)
    ).fetchone()
    last = int(row[0]) if row else 0
    upto = last
    into = Metrics(out)
    for block in Metrics(src).blocks_after(last):
        upto = block.id
        report.metrics += into.insert_columns(
            runs.get(block.run_id) if block.run_id is not None else None,
            sources.get(block.source_id) if block.source_id is not None else None,
            block.columns,
        )
    out.execute(
        "INSERT INTO merge_origins(origin, path, first_merged_at, last_merged_at, metrics_upto) "
        "VALUES (?, '', ?, ?, ?) ON CONFLICT(origin) DO UPDATE SET metrics_upto = "
        "excluded.metrics_upto",
        (origin, now_utc(), now_utc(), upto),
    )


def _incidents(out: Store, src: Store, origin: str) -> None:
    """Each node incident's lifecycle, for :func:`carry_over_resolutions`."""
    rows = src._conn.execute("SELECT id, status, resolved_at FROM incidents").fetchall()
    out._conn.executemany(
        "INSERT INTO merge_incidents(origin, src_id, status, resolved_at) VALUES (?,?,?,?) "
        "ON CONFLICT(origin, src_id) DO UPDATE SET status = excluded.status, "
        "resolved_at = excluded.resolved_at",
        [(origin, iid, status, resolved) for iid, status, resolved in rows],
    )


def carry_over_resolutions(out: Store) -> list[tuple[int, int]]:
    """Resolve open fleet incidents whose events all come from node incidents that are resolved
    on their node (an incident merged into another one follows that one: its events moved).
    Returns (incident id, new version) of those resolved."""
    rows = out._conn.execute(
        "SELECT i.id, i.version, i.detail, "
        "(SELECT max(mi.resolved_at) FROM events e JOIN merge_events me ON me.event_id = e.id "
        " JOIN merge_incidents mi ON mi.origin = me.origin AND mi.src_id = me.src_incident "
        " WHERE e.incident_id = i.id) "
        "FROM incidents i WHERE i.status = 'open' AND EXISTS "
        "(SELECT 1 FROM events e WHERE e.incident_id = i.id) AND NOT EXISTS "
        "(SELECT 1 FROM events e LEFT JOIN merge_events me ON me.event_id = e.id "
        " LEFT JOIN merge_incidents mi ON mi.origin = me.origin AND mi.src_id = me.src_incident "
        " WHERE e.incident_id = i.id AND coalesce(mi.status, 'open') != 'resolved')"
    ).fetchall()
    done = []
    with out.transaction():
        for iid, version, detail_json, resolved_at in rows:
            detail = json.loads(detail_json or "{}")
            detail["resolution"] = "resolved on every node it was seen on"
            out.execute(
                "UPDATE incidents SET status = 'resolved', resolved_at = ?, updated_at = ?, "
                "version = ?, detail = ? WHERE id = ?",
                (resolved_at or now_utc(), now_utc(), version + 1, json.dumps(detail), iid),
            )
            done.append((iid, version + 1))
    return done
