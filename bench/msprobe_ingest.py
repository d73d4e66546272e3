"""msprobe monitor ingestion: rows/s on a big generated tree; NaN-to-incident latency (watch).

    python bench/msprobe_ingest.py [--ranks 8 --steps 100 --params 250] [--latency-only]

Part 1 writes a V1 tree (every family, one file per rank/family/step, NaN at the second-to-last
step on one rank, then everywhere) and times `Pipeline.scan()` over it. Part 2 starts `nanwatch
watch` (a real process) on an empty folder, lets a 2-rank "training" write one step's CSVs every
0.3 s and measures the time from the NaN step's last CSV landing to the incident being in the
database with its origin.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAD_MICRO = "vpp_stage,name,step,micro_step,norm,min,max,mean,nans,zeros,shape,dtype\n"
HEAD = "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype\n"
FAMILIES = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "exp_avg",
    "exp_avg_sq",
    "param_origin",
    "param_updated",
)


def write_step(folder: Path, step: int, params: int, nan: bool) -> int:
    rows = 0
    for fam in FAMILIES:
        micro = fam in ("actv", "actv_grad")
        out = [HEAD_MICRO if micro else HEAD]
        m = "0," if micro else ""
        for i in range(params):
            if nan and (fam != "grad_unreduced" or i >= params // 2):
                out.append(
                    f"0,module.blocks.{i}.weight,{step},{m}nan,nan,nan,nan,64,0.0,"
                    '"[8, 8]",torch.bfloat16\n'
                )
            else:
                out.append(
                    f"0,module.blocks.{i}.weight,{step},{m}1.2345678,-0.0123456,0.0123456,0.0001234,"
                    f'0,0.0,"[8, 8]",torch.bfloat16\n'
                )
            rows += 1
        (folder / f"{fam}_{step}-{step}.csv").write_text("".join(out))
    return rows


def throughput(ranks: int, steps: int, params: int, runs: int = 1) -> dict[str, Any]:
    """Scan a generated tree ``runs`` times (fresh database each time); median figures."""
    from nanwatch.config import Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.detect.msprobe import MonitorReader
    from nanwatch.store import Store
    from nanwatch.stream import StreamState

    tmp = Path(tempfile.mkdtemp(prefix="nw-bench-"))
    try:
        rows = 0
        # the NaN: rank 3 at the second-to-last step, every rank at the last one (so that
        # doubling the steps doubles the healthy rows, not the NaN spreading)
        nan_at = steps - 2
        first = min(3, ranks - 1)  # the rank whose NaN comes first
        for r in range(ranks):
            d = tmp / "run" / "monitor_output" / f"Dec01_10-00-00-rank{r}-{r:08x}"
            d.mkdir(parents=True)
            for s in range(steps):
                rows += write_step(d, s, params, s > nan_at or (s == nan_at and r == first))
        files = sorted((tmp / "run").rglob("*.csv"))
        size = sum(f.stat().st_size for f in files)
        # the reader alone (no file tracking, no store): what parsing costs
        reader = MonitorReader()
        t0 = time.perf_counter()
        for f in files:
            reader.feed(f.read_bytes(), 0, StreamState(), str(f))
        reader_dt = time.perf_counter() - t0
        times = []
        for i in range(runs):
            store = Store.open(tmp / f"db{i}")
            t0 = time.perf_counter()
            pipe = Pipeline(Config(), store, [str(tmp / "run")])
            pipe.scan()
            times.append(time.perf_counter() - t0)
            events = store._conn.execute("SELECT count(*) FROM events").fetchone()[0]
            origin = json.loads(store._conn.execute("SELECT origin FROM incidents").fetchone()[0])
            store.close()
        dt = statistics.median(times)
        return {
            "rows": rows,
            "mb": round(size / 1e6, 1),
            "seconds": round(dt, 2),
            "rows_per_s": round(rows / dt),
            "reader_rows_per_s": round(rows / reader_dt),
            "mb_per_s": round(size / 1e6 / dt, 1),
            "events": events,
            "origin": f"rank {origin['rank']} step {origin['step']} {origin['tensor']}",
            "origin_ok": (origin["rank"], origin["step"]) == (first, nan_at),
            "runs": runs,
            "spread": round((max(times) - min(times)) / dt, 2),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def latency(trials: int = 3, params: int = 100) -> list[float]:
    out = []
    for _ in range(trials):
        tmp = Path(tempfile.mkdtemp(prefix="nw-lat-"))
        db = tmp / "db"
        job = tmp / "job"
        job.mkdir()
        watch = subprocess.Popen(
            [sys.executable, "-m", "nanwatch", "watch", "--quiet", "--db", str(db), str(job)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while not db.exists():
                time.sleep(0.05)
            time.sleep(1.0)
            dirs = []
            for r in range(2):
                d = job / "monitor_output" / f"Dec01_10-00-00-rank{r}-{r:08x}"
                d.mkdir(parents=True)
                dirs.append(d)
            nan_step = 6
            landed = 0.0
            for s in range(nan_step + 1):
                for r, d in enumerate(dirs):
                    write_step(d, s, params, s == nan_step and r == 1)
                landed = time.monotonic()
                if s < nan_step:
                    time.sleep(0.3)
            while True:
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                try:
                    row = conn.execute("SELECT origin FROM incidents").fetchone()
                except sqlite3.Error:
                    row = None
                finally:
                    conn.close()
                if row and json.loads(row[0]).get("step") == nan_step:
                    out.append(time.monotonic() - landed)
                    break
                if time.monotonic() - landed > 60:
                    raise SystemExit("no incident within 60 s")
                time.sleep(0.01)
        finally:
            watch.send_signal(signal.SIGTERM)
            watch.wait(30)
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--params", type=int, default=250)
    p.add_argument("--latency-only", action="store_true")
    a = p.parse_args()
    os.environ.setdefault("TZ", "UTC")
    if not a.latency_only:
        print("scan:", json.dumps(throughput(a.ranks, a.steps, a.params)))
    lat = latency()
    print(
        "watch: NaN step's CSVs landed -> incident with origin: "
        f"median {statistics.median(lat):.2f}s, max {max(lat):.2f}s over {len(lat)} trials"
    )


if __name__ == "__main__":
    main()
