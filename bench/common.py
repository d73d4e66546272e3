"""Helpers shared by the benchmark sections: timed child processes, medians, CPU and RSS."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NANWATCH = [sys.executable, "-m", "nanwatch"]
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Timed:
    """One child process: wall seconds, CPU seconds (user+sys), peak RSS (MiB), output."""

    wall: float
    cpu: float
    rss_mib: float
    stdout: str
    returncode: int


def timed(cmd: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> Timed:
    """Run ``cmd`` to its end; its own rusage (wait4) gives CPU and peak RSS."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, env={**os.environ, **(env or {})}
        )
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        text = out.read().decode(errors="replace")
        if proc.returncode != 0:
            sys.stderr.write(err.read().decode(errors="replace")[-3000:])
            raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}")
    return Timed(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, text, proc.returncode)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median: how noisy a figure was over its runs."""
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def percentile(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, in ns resolution (schedstat) where available:
    utime/stime count 10 ms clock ticks, too coarse for an idle daemon."""
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that just ended
        if total:
            return total / 1e9
    except OSError:
        pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def own_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
