"""Fleet mode on a real PostgreSQL: forwarding rate, time to the fleet root, size, reads.

``nodes`` nodes of 8 ranks each run one launch (the seed case at scale: one rank runs out of
NPU memory in validation, every other rank's HCCL collective times out naming it). Each node's
logs are scanned into its own database first (not timed), then:

- **forward**: each node forwards everything it holds (events/s per node, median);
- **root latency**: every node but the root's has forwarded and been correlated; the root
  node's events then arrive, and the figure is the time until the fleet store holds the fleet
  incident with that root (one correlator cycle: pull, correlate, publish);
- **size**: the fleet store's tables (bytes per node and per event);
- **reads**: `incidents` and `show` on the fleet store, in-process and as `nanwatch ... --db
  postgresql://...` processes.

PostgreSQL is Debian's server started on loopback in a temporary directory (as in the tests).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import NANWATCH, median, timed


def run(nodes: int, per_node: int = 8, reads: int = 5) -> dict[str, Any]:
    from nanwatch.config import ClusterConfig, Config, FleetConfig
    from nanwatch.correlate import Correlator
    from nanwatch.correlate.fleet import FleetCorrelator
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.notify.forward import Forwarder
    from nanwatch.store import Store
    from nanwatch.store.fleet import FleetStore
    from tests.cluster_logs import write_fleet
    from tests.pg_server import PASSWORD, PgServer

    oom_rank = (nodes // 2) * per_node + 3
    root_node = f"node-{oom_rank // per_node:02d}"
    base = Path(tempfile.mkdtemp(prefix="nanwatch-bench-fleet-"))
    server = PgServer().start()
    try:
        dsn = server.create_database("bench")
        os.environ["PGPASSWORD"] = PASSWORD
        logs = write_fleet(base / "logs", nodes=nodes, per_node=per_node, oom_rank=oom_rank)
        dbs: dict[str, Path] = {}
        for node, path in logs.items():
            dbs[node] = base / f"{node}.db"
            store = Store.open(dbs[node])
            try:
                Pipeline(Config(cluster=ClusterConfig(node=node)), store, [str(path)]).scan()
            finally:
                store.close()

        config = Config(fleet=FleetConfig(dsn=dsn))
        work = Store.open(base / "work.db")
        fleet = FleetStore.connect(dsn)
        correlator = FleetCorrelator(fleet, work, Correlator(work))
        rates, events = [], 0
        now = time.time()
        for node in [n for n in dbs if n != root_node] + [root_node]:
            if node == root_node:
                correlator.cycle(now=now)  # everything else is in and correlated
            store = Store.open(dbs[node])
            try:
                fwd = Forwarder(config, node=node)
                t0 = time.perf_counter()
                report = fwd.forward(store, now=now)
                dt = time.perf_counter() - t0
                fwd.close()
            finally:
                store.close()
            events += report.events
            rates.append(report.events / dt if dt else 0.0)
        from nanwatch.cli.fleet import _publish

        t0 = time.perf_counter()
        cycle = correlator.cycle(now=now)
        _publish(fleet, work, cycle.touched, {}, now=now)
        latency = time.perf_counter() - t0
        docs = fleet.incidents()
        root = next((d for d in docs if d["kind"] == "oom"), None)

        size = 0
        with fleet._tx() as cur:  # a figure, not an API: the bench reads the catalogue
            cur.execute(
                "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = 'public' AND c.relkind = 'r'"
            )
            row = cur.fetchone()
            size = int(row[0] or 0) if row else 0
        # after the size: the backlog node is not one of the launch's
        bulk_rate, bulk_events = _bulk_forward(base, config, now)

        incident_ms, show_ms = [], []
        inc_id = int(root["id"]) if root else int(docs[0]["id"])
        for _ in range(reads):
            t0 = time.perf_counter()
            fleet.incidents()
            incident_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            fleet.story(inc_id)
            show_ms.append((time.perf_counter() - t0) * 1000)
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        proc_inc = median(
            [timed([*NANWATCH, "incidents", "--db", dsn], env=env).wall * 1000 for _ in range(3)]
        )
        proc_show = median(
            [
                timed([*NANWATCH, "show", str(inc_id), "--db", dsn], env=env).wall * 1000
                for _ in range(3)
            ]
        )
        fleet.close()
        work.close()
        return {
            "nodes": nodes,
            "ranks": nodes * per_node,
            "events": events,
            "forward_events_per_s": round(median(rates)),
            "bulk_forward_events": bulk_events,
            "bulk_forward_events_per_s": round(bulk_rate),
            "root_latency_s": round(latency, 3),
            "root_found": bool(root and root["origin"].get("rank") == oom_rank),
            "root_title": root["title"] if root else None,
            "incidents": len(docs),
            "store_bytes": size,
            "bytes_per_node": size // nodes,
            "bytes_per_event": round(size / events, 1) if events else None,
            "incidents_ms": round(median(incident_ms), 1),
            "show_ms": round(median(show_ms), 1),
            "incidents_process_ms": round(proc_inc, 1),
            "show_process_ms": round(proc_show, 1),
        }
    finally:
        os.environ.pop("PGPASSWORD", None)
        server.close()
        shutil.rmtree(base, ignore_errors=True)


def _bulk_forward(base: Path, config: Any, now: float, n: int = 50_000) -> tuple[float, int]:
    """A node with a backlog (``n`` events, e.g. after the fleet store was down): events/s of
    one forward of all of it, in batches of the forwarder's size."""
    from nanwatch.events import Event
    from nanwatch.notify.forward import Forwarder
    from nanwatch.store import Store

    store = Store.open(base / "backlog.db")
    try:
        with store.transaction():
            store.insert_events(
                None,
                None,
                [
                    Event("comm_timeout", f"HCCL collective timed out on rank {i % 8}", offset=i,
                          rank=i % 8, step=i // 8, fields={"backend": "hccl"})
                    for i in range(n)
                ],
                "2026-11-30T10:00:00.000Z",
            )  # fmt: skip
        fwd = Forwarder(config, node="node-backlog")
        t0 = time.perf_counter()
        report = fwd.forward(store, now=now)
        dt = time.perf_counter() - t0
        while report.waiting and not report.error:
            t1 = time.perf_counter()
            report = fwd.forward(store, now=now)
            dt += time.perf_counter() - t1
        fwd.close()
    finally:
        store.close()
    return (n / dt if dt else 0.0), n
