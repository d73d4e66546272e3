"""What `nanwatch watch` costs a training node: CPU and memory while following 64 rank logs.

Starts the real daemon (`python -m nanwatch watch`) on 8 mmengine runs x 8 ranks, waits for
READY=1 on a notify socket of its own (as systemd would), then samples the process's
utime+stime (/proc/PID/stat) and VmRSS (/proc/PID/status) over the measuring window:

    .venv/bin/python bench/idle.py                       # 60 s quiet, inotify
    .venv/bin/python bench/idle.py --mode poll           # the network-filesystem mode
    .venv/bin/python bench/idle.py --write-every 10      # ranks log a line every 10 s each
    .venv/bin/python bench/idle.py --rate 1000 --runs 1  # 8 ranks logging 1,000 lines/s each
    .venv/bin/python bench/idle.py --scrape-every 15     # [metrics] on, scraped like Prometheus
    .venv/bin/python bench/idle.py --watchdog 60         # the unit's WatchdogSec (ticks every 30 s)

CPU is the share of one core over the window; RSS is reported at its min/max over the
samples (a flat line is min == max, give or take a page). ``--windows N`` splits the window
in N parts and reports each part's CPU too (their median is robust to a neighbour's burst).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/idle.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_seconds, median, rss_mib
from bench.daemon import Daemon
from nanwatch.demo.simulate import TrainingRun, mmengine_iter_line


def make_runs(base: Path, runs: int, ranks: int, iters: int) -> list[Path]:
    files = []
    for i in range(runs):
        run = TrainingRun(base / f"exp{i}", ranks=ranks, epochs=1, iters=iters, nan_rank=None)
        run.nan_at = None
        files += run.write()
    return files


def _iteration(it: int) -> bytes:
    line = mmengine_iter_line(
        dt.datetime.now(),
        "train",
        1,
        it,
        10**6,
        step_time=0.5,
        grad_norm=1.0,
        losses={"loss": 0.5, "loss_cls": 0.25, "loss_bbox": 0.125, "loss_iou": 0.125},
    )
    return (line + "\n").encode()


def measure(
    *,
    seconds: float = 60.0,
    runs: int = 8,
    ranks: int = 8,
    iters: int = 200,
    mode: str = "auto",
    write_every: float = 0.0,
    rate: float = 0.0,
    scrape_every: float = 0.0,
    watchdog: float = 0.0,
    windows: int = 1,
    settle: float = 5.0,
) -> dict[str, Any]:
    """One daemon, one measuring window; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="nanwatch-idle-") as tmp:
        base = Path(tmp)
        files = make_runs(base / "work_dirs", runs, ranks, iters)
        config = base / "nanwatch.toml"
        config.write_text(f'[sources]\npaths = ["{base / "work_dirs"}"]\nmode = "{mode}"\n')
        port = 0
        if scrape_every:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with config.open("a") as f:
                f.write(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        usec = int(watchdog * 1e6) if watchdog else None
        handles = [f.open("ab", buffering=0) for f in files] if (rate or write_every) else []
        try:
            with Daemon(config, base / "nw.db", base, watchdog_usec=usec) as d:
                time.sleep(settle)  # let start-up work (imports, first pass, correlation) settle
                rss = [rss_mib(d.pid)]
                c0, w0 = cpu_seconds(d.pid), time.monotonic()
                cuts = [(c0, w0)]
                end = w0 + seconds
                step = seconds / windows
                next_cut = w0 + step
                next_write = w0 + write_every if write_every else float("inf")
                next_scrape = w0 + scrape_every if scrape_every else float("inf")
                tick = 0.01 if rate else 0.5
                batch = max(1, round(rate * tick)) if rate else 0
                next_batch = w0
                it = iters
                lines = 0
                while time.monotonic() < end:
                    now = time.monotonic()
                    if rate and now >= next_batch:
                        # each rank's lines of one 10 ms slice in one write(2)
                        data = b"".join(_iteration(it + k) for k in range(batch))
                        it += batch
                        for h in handles:
                            h.write(data)
                        lines += batch * len(handles)
                        next_batch += batch / rate
                    if now >= next_write:
                        it += 1
                        data = _iteration(it)
                        for h in handles:
                            h.write(data)
                        lines += len(handles)
                        next_write += write_every
                    if now >= next_scrape:
                        url = f"http://127.0.0.1:{port}/metrics"
                        with urllib.request.urlopen(url, timeout=10) as resp:
                            assert b"nanwatch_files_followed" in resp.read()
                        next_scrape += scrape_every
                    if now >= next_cut:
                        cuts.append((cpu_seconds(d.pid), now))
                        rss.append(rss_mib(d.pid))
                        next_cut += step
                    wake = min(next_batch if rate else end, next_write, next_scrape, next_cut)
                    time.sleep(min(tick, max(0.0, wake - time.monotonic())))
                c1, w1 = cpu_seconds(d.pid), time.monotonic()
                if len(cuts) <= windows:
                    cuts.append((c1, w1))
                rss.append(rss_mib(d.pid))
                threads = len(os.listdir(f"/proc/{d.pid}/task"))
                ready = d.ready_after
        finally:
            for h in handles:
                h.close()
    parts = [
        100 * (b[0] - a[0]) / (b[1] - a[1]) for a, b in itertools.pairwise(cuts) if b[1] > a[1]
    ]
    return {
        "files": len(files),
        "mode": mode,
        "write_every_s": write_every or None,
        "lines_per_s_per_file": rate or None,
        "lines_written": lines,
        "scrape_every_s": scrape_every or None,
        "watchdog_s": watchdog or None,
        "window_s": round(w1 - w0, 1),
        "cpu_percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 3),
        "cpu_percent_windows": [round(p, 3) for p in parts],
        "cpu_percent_median_window": round(median(parts), 3) if parts else None,
        "cpu_seconds": round(c1 - c0, 3),
        "rss_mib_min": round(min(rss), 1),
        "rss_mib_max": round(max(rss), 1),
        "threads": threads,
        "ready_after_s": round(ready, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200, help="lines already in each file")
    ap.add_argument("--mode", choices=["auto", "inotify", "poll"], default="auto")
    ap.add_argument("--write-every", type=float, default=0.0, help="append a line per file")
    ap.add_argument("--rate", type=float, default=0.0, help="lines per second per file")
    ap.add_argument("--scrape-every", type=float, default=0.0, help="serve and scrape /metrics")
    ap.add_argument("--watchdog", type=float, default=0.0, help="WatchdogSec of the unit")
    ap.add_argument("--windows", type=int, default=1)
    args = ap.parse_args()
    result = measure(
        seconds=args.seconds,
        runs=args.runs,
        ranks=args.ranks,
        iters=args.iters,
        mode=args.mode,
        write_every=args.write_every,
        rate=args.rate,
        scrape_every=args.scrape_every,
        watchdog=args.watchdog,
        windows=args.windows,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
