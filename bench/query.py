"""Read-side latency on a million events: `incidents`, `show`, `events --kind`, `--grep`.

The database is made of real scans, then copied: the seed case (an NPU out-of-memory with HCCL
timeouts on seven ranks; a NaN located by msprobe; a slowdown) and an msprobe run whose NaN
spreads to every tensor of 8 ranks (thousands of events in one incident) are scanned once
into a template; its runs, files, events, metrics and incidents are then copied with fresh
ids (SQL, in one transaction) until the events table holds about a million rows.

Each command is timed in-process (click's runner: argument parsing, query, rendering; the
imports are done once) and as a process (`python -m nanwatch ...`: what a person waits for,
interpreter start-up included).
"""

from __future__ import annotations

import io
import shutil
import sqlite3
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from .common import NANWATCH, median, timed
from .inputs import msprobe_tree


def build(base: Path, target_events: int) -> tuple[Path, dict[str, Any]]:
    """A database with about ``target_events`` events; returns it and what to query."""
    from nanwatch.config import Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.demo.simulate import seed_scenario
    from nanwatch.store import Store

    seed = base / "seed"
    for run in seed_scenario(seed):
        run.write()
    spread = base / "spread"
    spread.mkdir()
    msprobe_tree(spread, ranks=8, steps=12, params=200)
    db = base / "million.db"
    store = Store.open(db)
    try:
        for path in (seed / "work_dirs", spread):
            Pipeline(Config(), store, [str(path)]).scan()
    finally:
        store.close()
    conn = sqlite3.connect(db, isolation_level=None)
    t0 = time.perf_counter()
    try:
        template = conn.execute("SELECT count(*) FROM events").fetchone()[0]
        copies = max(0, -(-target_events // template) - 1)
        _copy(conn, copies)
        conn.execute("ANALYZE")
        facts = {
            "events": conn.execute("SELECT count(*) FROM events").fetchone()[0],
            "metrics": conn.execute("SELECT coalesce(sum(n), 0) FROM metric_blocks").fetchone()[0],
            "incidents": conn.execute(
                "SELECT count(*) FROM incidents WHERE status != 'merged'"
            ).fetchone()[0],
            "runs": conn.execute("SELECT count(*) FROM runs").fetchone()[0],
            "mib": round(db.stat().st_size / 2**20, 1),
            "build_s": round(time.perf_counter() - t0, 1),
            # the biggest incident of a copy in the middle of the table, and a small one
            "big": conn.execute(
                "SELECT incident_id FROM events WHERE incident_id IS NOT NULL AND id > "
                "(SELECT max(id) / 2 FROM events) GROUP BY incident_id "
                "ORDER BY count(*) DESC LIMIT 1"
            ).fetchone()[0],
            "small": conn.execute(
                "SELECT i.id FROM incidents i WHERE i.kind = 'oom' AND i.id > "
                "(SELECT max(id) / 2 FROM incidents) ORDER BY i.id LIMIT 1"
            ).fetchone()[0],
        }
    finally:
        conn.close()
    return db, facts


def _copy(conn: sqlite3.Connection, copies: int) -> None:
    """``copies`` more of everything, with ids (and unique names) shifted per copy."""
    top = {
        t: conn.execute(f"SELECT coalesce(max(id), 0) FROM {t}").fetchone()[0]
        for t in ("runs", "sources", "events", "metric_blocks", "incidents")
    }
    cols = {
        t: [r[1] for r in conn.execute(f"PRAGMA table_info({t})")]
        for t in ("runs", "sources", "events", "metric_blocks", "incidents")
    }

    def shifted(table: str, k: int, changes: dict[str, str]) -> str:
        exprs = [changes.get(c, c) for c in cols[table]]
        return (
            f"INSERT INTO {table}({', '.join(cols[table])}) SELECT {', '.join(exprs)} "
            f"FROM {table} WHERE id <= {top[table]}"
        )

    conn.execute("BEGIN")
    for k in range(1, copies + 1):
        run = f"run_id + {k * top['runs']}"
        src = f"source_id + {k * top['sources']}"
        inc = f"incident_id + {k * top['incidents']}"
        conn.execute(
            shifted(
                "runs",
                k,
                {
                    "id": f"id + {k * top['runs']}",
                    "name": f"name || '~{k}'",
                    "root": f"root || '~{k}'",
                    "experiment": f"experiment || '~{k // 4}'",
                },
            )
        )
        conn.execute(
            shifted(
                "sources",
                k,
                {
                    "id": f"id + {k * top['sources']}",
                    "run_id": run,
                    "ino": f"ino + {k << 32}",
                    "path": f"path || '~{k}'",
                },
            )
        )
        conn.execute(
            shifted(
                "incidents",
                k,
                {"id": f"id + {k * top['incidents']}", "run_id": run, "root_event_id": "NULL"},
            )
        )
        conn.execute(
            shifted(
                "events",
                k,
                {
                    "id": f"id + {k * top['events']}",
                    "run_id": run,
                    "source_id": src,
                    "incident_id": inc,
                },
            )
        )
        conn.execute(
            shifted(
                "metric_blocks",
                k,
                {"id": f"id + {k * top['metric_blocks']}", "run_id": run, "source_id": src},
            )
        )
    conn.execute("COMMIT")


def _inproc(args: list[str], runs: int) -> float:
    from nanwatch.cli import cli

    times = []
    for _ in range(runs + 1):
        out = io.StringIO()
        t0 = time.perf_counter()
        with redirect_stdout(out):
            try:
                cli.main(args=args, prog_name="nanwatch", standalone_mode=False)
            except SystemExit as e:
                assert not e.code, e
        times.append(time.perf_counter() - t0)
        assert out.getvalue()
    return median(times[1:])  # the first one pays the command's imports


def run(target_events: int, runs: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="nanwatch-bench-query-"))
    try:
        db, facts = build(tmp, target_events)
        d = ["--db", str(db)]
        queries = {
            "incidents": ["incidents", *d],
            "incidents --open --json": ["incidents", "--open", "--json", *d],
            "show (biggest)": ["show", str(facts["big"]), *d],
            "show (small)": ["show", str(facts["small"]), *d],
            "events --kind oom": ["events", "--kind", "oom", *d],
            "events --kind nan --limit 100": ["events", "--kind", "nan", "--limit", "100", *d],
            # full-text search (the events_fts index): a rare code, then a common phrase
            "events --grep EI0002 --json": ["events", "--grep", "EI0002", "--json", *d],
            "events --grep 'out of memory' --limit 100": [
                "events",
                "--grep",
                "out of memory",
                "--limit",
                "100",
                *d,
            ],
        }
        results = {}
        for name, args in queries.items():
            inproc = _inproc(args, runs)
            proc = median([timed([*NANWATCH, *args]).wall for _ in range(runs)])
            results[name] = {"ms": round(1000 * inproc, 1), "process_ms": round(1000 * proc, 1)}
        return {"db": facts, "queries": results}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
