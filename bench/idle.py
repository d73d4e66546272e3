"""What `nanwatch watch` costs a training node: CPU and memory while following 64 rank logs.

Starts the real daemon (`python -m nanwatch watch`) on 8 mmengine runs x 8 ranks, waits for
READY=1 on a notify socket of its own (as systemd would), then samples the process's
utime+stime (/proc/PID/stat) and VmRSS (/proc/PID/status) over the measuring window:

    .venv/bin/python bench/idle.py                       # 60 s quiet, inotify
    .venv/bin/python bench/idle.py --mode poll           # the network-filesystem mode
    .venv/bin/python bench/idle.py --write-every 10      # ranks log a line every 10 s each
    .venv/bin/python bench/idle.py --scrape-every 15     # [metrics] on, scraped like Prometheus

CPU is the share of one core over the window; RSS is reported at its min/max over the
samples (a flat line is min == max, give or take a page).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanwatch.simulate import TrainingRun, mmengine_iter_line  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def make_runs(base: Path, runs: int, ranks: int, iters: int) -> list[Path]:
    files = []
    for i in range(runs):
        run = TrainingRun(base / f"exp{i}", ranks=ranks, epochs=1, iters=iters, nan_rank=None)
        run.nan_at = None
        files += run.write()
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200, help="lines already in each file")
    ap.add_argument("--mode", choices=["auto", "inotify", "poll"], default="auto")
    ap.add_argument("--write-every", type=float, default=0.0, help="append a line per file")
    ap.add_argument("--scrape-every", type=float, default=0.0, help="serve and scrape /metrics")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="nanwatch-idle-") as tmp:
        base = Path(tmp)
        files = make_runs(base / "work_dirs", args.runs, args.ranks, args.iters)
        config = base / "nanwatch.toml"
        config.write_text(f'[sources]\npaths = ["{base / "work_dirs"}"]\nmode = "{args.mode}"\n')
        if args.scrape_every:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with config.open("a") as f:
                f.write(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(base / "notify.sock"))
        sock.settimeout(120)
        env = {**os.environ, "NOTIFY_SOCKET": str(base / "notify.sock")}
        cmd = [sys.executable, "-m", "nanwatch", "watch", "--quiet", "--config", str(config)]
        cmd += ["--db", str(base / "nw.db")]
        errlog = base / "daemon.err"
        with errlog.open("wb") as err:
            proc = subprocess.Popen([*cmd, "-v"], env=env, stderr=err)
        try:
            t_start = time.monotonic()
            while b"READY=1" not in sock.recv(4096):
                pass
            ready_s = time.monotonic() - t_start
            time.sleep(5)  # let start-up work (imports, first pass, correlation) settle
            rss = [rss_kib(proc.pid)]
            c0, w0 = cpu_seconds(proc.pid), time.monotonic()
            end = w0 + args.seconds
            next_write = w0 + args.write_every if args.write_every else float("inf")
            next_scrape = w0 + args.scrape_every if args.scrape_every else float("inf")
            it = args.iters
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_write:
                    it += 1
                    line = mmengine_iter_line(
                        dt.datetime.now(),
                        "train",
                        1,
                        it,
                        10**6,
                        step_time=0.5,
                        grad_norm=1.0,
                        losses={"loss": 0.5},
                    )
                    for f in files:
                        with f.open("a") as h:
                            h.write(line + "\n")
                    next_write += args.write_every
                if now >= next_scrape:
                    url = f"http://127.0.0.1:{port}/metrics"
                    with urllib.request.urlopen(url, timeout=10) as resp:
                        assert b"nanwatch_files_followed" in resp.read()
                    next_scrape += args.scrape_every
                time.sleep(min(1.0, max(0.01, end - time.monotonic())))
                rss.append(rss_kib(proc.pid))
            c1, w1 = cpu_seconds(proc.pid), time.monotonic()
            threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            sock.close()
            if code != 0:
                sys.stderr.write(errlog.read_text(errors="replace")[-4000:])
    result = {
        "files": len(files),
        "mode": args.mode,
        "write_every_s": args.write_every or None,
        "scrape_every_s": args.scrape_every or None,
        "window_s": round(w1 - w0, 1),
        "cpu_percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 3),
        "cpu_seconds": round(c1 - c0, 3),
        "rss_mib_min": round(min(rss) / 1024, 1),
        "rss_mib_max": round(max(rss) / 1024, 1),
        "threads": threads,
        "ready_after_s": round(ready_s, 2),
        "exit_status": code,
    }
    print(json.dumps(result))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
