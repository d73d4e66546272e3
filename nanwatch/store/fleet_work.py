"""The fleet correlator's working database: what `nanwatch fleet` pulled, in the node schema.

Pulled events go into a SQLite database with the node schema (sources keyed by node, as in
``nanwatch merge``), in one transaction with the pull cursor, so the node correlator runs over
every node as over one: see ``correlate/fleet.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .db import Store
from .fleet import FleetEvent
from .records import JSON

__all__ = ["PULLED_UPTO", "import_events", "import_lifecycles", "pulled_upto", "work_members"]


def _dumps(value: JSON) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


PULLED_UPTO = "fleet.pulled_upto"


def pulled_upto(work: Store) -> int:
    return int(work.meta_get(PULLED_UPTO, "0") or 0)


def import_events(work: Store, events: Sequence[FleetEvent]) -> int:
    """Pulled fleet events into the working database, in one transaction with the cursor.

    Runs map the way ``nanwatch merge`` maps them: a run with a cluster-wide identity (job and
    run labels) is one run whatever node saw it; a node-local run stays ``NAME@NODE``. Sources
    are keyed by node (inodes of two nodes collide). Each event is linked to the node incident
    it belonged to (``merge_events``), which carries lifecycles over and lists the members.
    """
    if not events:
        return 0
    runs: dict[tuple[str, int], int] = {}
    sources: dict[tuple[str, int], int] = {}
    added = 0
    with work.transaction():
        for ev in events:
            run_id = None
            if ev.run is not None:
                k = (ev.node, int(ev.run["src_id"]))
                if k not in runs:
                    runs[k] = _work_run(work, ev.node, ev.run)
                run_id = runs[k]
            source_id = None
            if ev.source is not None:
                k = (ev.node, int(ev.source["src_id"]))
                if k not in sources:
                    sources[k] = _work_source(work, ev.node, run_id, ev.source)
                source_id = sources[k]
            cur = work.execute(
                "INSERT OR IGNORE INTO events(kind, time, ingested_at, run_id, source_id, offset, "
                "key, line, rank, local_rank, node, epoch, iter, step, stage, device, message, "
                "fields) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    ev.kind, ev.time, ev.ingested_at, run_id, source_id, ev.offset, ev.key,
                    ev.line, ev.rank, ev.local_rank, ev.host or ev.node, ev.epoch, ev.iter,
                    ev.step, ev.stage, ev.device, ev.message, _dumps(dict(ev.fields)),
                ),
            )  # fmt: skip
            if cur.rowcount:
                added += 1
                work.execute(
                    "INSERT OR IGNORE INTO merge_events(event_id, origin, src_id, src_incident) "
                    "VALUES (?,?,?,?)",
                    (cur.lastrowid, f"fleet:{ev.node}", ev.src_id, ev.src_incident),
                )
        work.meta_set(PULLED_UPTO, str(events[-1].id))
    return added


def _work_run(work: Store, node: str, run: Mapping[str, JSON]) -> int:
    job, crun = run.get("job"), run.get("cluster_run")
    if job:
        root, launch, name = f"cluster:{job}", str(crun or job), str(run["name"])
    else:
        root = f"node:{node}:{run['root']}"
        launch, name = str(run["launch"]), f"{run['name']}@{node}"
    rid = work.run_id(
        root, launch, name, experiment=run.get("experiment"), node=node, job=job or None
    )
    work.execute(
        "UPDATE runs SET cluster_run = coalesce(cluster_run, ?), "
        "node = CASE WHEN node IS ? THEN node ELSE NULL END WHERE id = ?",
        (crun if job else None, node, rid),
    )
    facts = run.get("facts")
    if isinstance(facts, Mapping) and facts:
        work.update_run_facts(rid, facts)
    return rid


def _work_source(work: Store, node: str, run_id: int | None, src: Mapping[str, JSON]) -> int:
    now = work.meta_get("fleet.now") or "1970-01-01T00:00:00Z"
    work.execute(
        "INSERT INTO sources(run_id, path, root, dev, ino, gen, offset, status, created_at, "
        "updated_at, node) VALUES (?,?,?,?,?,?,0,'remote',?,?,?) "
        "ON CONFLICT(dev, ino, gen, node) DO UPDATE SET path = excluded.path, "
        "run_id = coalesce(excluded.run_id, run_id)",
        (run_id, src["path"], src["root"], src["dev"], src["ino"], src["gen"], now, now, node),
    )
    row = work._conn.execute(
        "SELECT id FROM sources WHERE dev = ? AND ino = ? AND gen = ? AND node = ?",
        (src["dev"], src["ino"], src["gen"], node),
    ).fetchone()
    return int(row[0])


def import_lifecycles(work: Store, rows: Sequence[tuple[str, int, str, str | None]]) -> None:
    """Node incidents' statuses, so a fleet incident resolves once all its node incidents did."""
    with work.transaction():
        work._conn.executemany(
            "INSERT INTO merge_incidents(origin, src_id, status, resolved_at) VALUES (?,?,?,?) "
            "ON CONFLICT(origin, src_id) DO UPDATE SET status = excluded.status, "
            "resolved_at = excluded.resolved_at",
            [(f"fleet:{node}", src, status, at) for node, src, status, at in rows],
        )


def work_members(work: Store, incident_ids: Sequence[int]) -> list[tuple[str, int, int]]:
    """(node, node incident, fleet incident) for the events of these fleet incidents."""
    if not incident_ids:
        return []
    marks = ",".join("?" * len(incident_ids))
    rows = work._conn.execute(
        "SELECT DISTINCT me.origin, me.src_incident, e.incident_id FROM events e "
        "JOIN merge_events me ON me.event_id = e.id "
        f"WHERE e.incident_id IN ({marks}) AND me.src_incident IS NOT NULL",
        list(incident_ids),
    ).fetchall()
    return [(str(o).removeprefix("fleet:"), int(s), int(i)) for o, s, i in rows]
