"""`make bench` / `python -m bench [--quick] [--only scan,live] [--compare OLD.json]`.

Generates the inputs, runs every section, prints one table and writes the raw figures to
bench/results.json (bench/results-quick.json with --quick) so that changes can be compared:
`--compare bench/results.json` adds a column with the change against an earlier run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import ROOT
from .table import Row, render, rows_for

# (full, quick) sizes of every section
PLAN: dict[str, dict[str, Any]] = {
    "startup": {"full": {"runs": 7}, "quick": {"runs": 3}},
    "scan": {
        "full": {"mb": 256, "runs": 3, "plog_mb": 64},
        "quick": {"mb": 32, "runs": 2, "plog_mb": 8},
    },
    "msprobe": {
        "full": {"ranks": 8, "steps": 40, "params": 250, "runs": 3, "trials": 3},
        "quick": {"ranks": 8, "steps": 10, "params": 250, "runs": 1, "trials": 1},
    },
    "live": {
        "full": {"probes": 200, "gap": 0.05, "poll_probes": 40, "slack": 5},
        "quick": {"probes": 50, "gap": 0.05, "poll_probes": 10, "slack": 2},
    },
    "idle": {
        "full": {"seconds": 60, "poll_seconds": 30, "load_seconds": 30, "tick_seconds": 30},
        "quick": {"seconds": 15, "poll_seconds": 10, "load_seconds": 10, "tick_seconds": 10},
    },
    "query": {"full": {"events": 1_000_000, "runs": 5}, "quick": {"events": 200_000, "runs": 3}},
    "adversarial": {"full": {"mb": 1.0}, "quick": {"mb": 0.25}},
    "fleet": {"full": {"nodes": 128, "reads": 5}, "quick": {"nodes": 16, "reads": 3}},
    "hook": {
        "full": {"iters": 20000, "batch": 16, "repeat": 5},
        "quick": {"iters": 5000, "batch": 16, "repeat": 3},
    },
}


def machine() -> dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu": model,
        "python": platform.python_version(),
        "sqlite": __import__("sqlite3").sqlite_version,
        "kernel": platform.release(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
    }


def _scan(p: dict[str, Any]) -> dict[str, Any]:
    from . import scan

    return scan.run(p["mb"], p["runs"], p["plog_mb"])


def _msprobe(p: dict[str, Any]) -> dict[str, Any]:
    from . import msprobe_ingest as m

    half = m.throughput(p["ranks"], p["steps"] // 2, p["params"], runs=p["runs"])
    full = m.throughput(p["ranks"], p["steps"], p["params"], runs=p["runs"])
    lat = m.latency(trials=p["trials"])
    return {
        "half": half,
        "full": full,
        "growth_time": round(full["seconds"] / half["seconds"], 2),
        "latency_s": [round(x, 3) for x in lat],
    }


def _live(p: dict[str, Any]) -> dict[str, Any]:
    from . import live

    return {
        "inotify": live.latency("inotify", probes=p["probes"], gap=p["gap"]),
        "poll": live.latency("poll", probes=p["poll_probes"], gap=0.2, poll_interval=1.0),
        "slack": live.slack(p["slack"]),
    }


def _idle(p: dict[str, Any]) -> dict[str, Any]:
    from . import idle

    return {
        # the unit's WatchdogSec=60s: a tick every 30 s, a full check every 30 s
        "inotify": idle.measure(seconds=p["seconds"], watchdog=60, windows=6),
        "poll": idle.measure(seconds=p["poll_seconds"], mode="poll", windows=3),
        # a tick every second: what a pass that finds nothing costs
        "ticks": idle.measure(seconds=p["tick_seconds"], watchdog=2, windows=3),
        "load": idle.measure(seconds=p["load_seconds"], runs=1, rate=1000, windows=3),
    }


def _query(p: dict[str, Any]) -> dict[str, Any]:
    from . import query

    return query.run(p["events"], p["runs"])


def _startup(p: dict[str, Any]) -> dict[str, Any]:
    from . import startup

    return startup.run(p["runs"])


def _adversarial(p: dict[str, Any]) -> dict[str, Any]:
    from . import adversarial

    return adversarial.run(p["mb"])


def _fleet(p: dict[str, Any]) -> dict[str, Any]:
    from . import fleet

    return fleet.run(p["nodes"], reads=p["reads"])


def _hook(p: dict[str, Any]) -> dict[str, Any]:
    # in a process of its own: torch and mmengine stay out of this one
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.hook_overhead",
            f"--iters={p['iters']}",
            f"--batch={p['batch']}",
            f"--repeat={p['repeat']}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if not out.stdout.strip():
        raise RuntimeError(f"bench.hook_overhead failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


SECTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "startup": _startup,
    "scan": _scan,
    "msprobe": _msprobe,
    "live": _live,
    "idle": _idle,
    "query": _query,
    "adversarial": _adversarial,
    "fleet": _fleet,
    "hook": _hook,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small inputs, fewer runs (~2 min)")
    ap.add_argument("--only", default="", help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--out", type=Path, default=None, help="where the JSON results go")
    ap.add_argument("--compare", type=Path, default=None, help="an earlier results file")
    args = ap.parse_args(argv)
    os.environ.setdefault("TZ", "UTC")
    time.tzset()
    # nanwatch's processes may cache bytecode even where this environment forbids it: an
    # installed wheel's modules are compiled at install time, so compiling them at every start
    # would measure a set-up nanwatch does not run in
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    wanted = [s.strip() for s in args.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    size = "quick" if args.quick else "full"
    out = args.out or ROOT / "bench" / ("results-quick.json" if args.quick else "results.json")
    results: dict[str, Any] = {
        "machine": machine(),
        "mode": size,
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sections": {},
        "seconds": {},
    }
    t_all = time.monotonic()
    for name in wanted:
        params = PLAN[name][size]
        print(f"[bench] {name} {json.dumps(params)} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        results["sections"][name] = {"params": params, **SECTIONS[name](params)}
        results["seconds"][name] = round(time.monotonic() - t0, 1)
    results["seconds"]["total"] = round(time.monotonic() - t_all, 1)
    results["machine"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    old = json.loads(args.compare.read_text()) if args.compare else None
    rows: list[Row] = rows_for(results, old)
    results["table"] = [r.as_dict() for r in rows_for(results)]  # no comparison: it stands alone
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results, rows, compared=args.compare))
    print(f"\n(raw figures: {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
