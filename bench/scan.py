"""Catch-up `nanwatch scan` throughput against `grep -E -c -i` on the same files.

Each run scans into a fresh database as a real process; its start-up (the same command on an
empty folder) is measured in the same loop and subtracted. grep and scan alternate, so a busy
neighbour slows both alike, and the ratio is taken per pair, then the median. The mmengine
inputs are scanned twice: with the compiled chunk core (when it is built) and in pure Python
(``NANWATCH_PURE=1``), side by side.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from nanwatch.detect.core import PURE_ENV, status

from .common import NANWATCH, median, spread, timed
from .inputs import mmengine_logs, plogs

GREP = (
    ": ?(nan|inf)|out of memory|timeout|timed out|E[IJL][0-9]{4}|error|exception|traceback"
    "|sig(kill|segv|abrt)|overflow"
)


def _scan_once(
    paths: list[str], db: Path, env: dict[str, str] | None = None
) -> tuple[float, float, dict[str, Any]]:
    for p in db.parent.glob(db.name + "*"):
        p.unlink()
    t = timed([*NANWATCH, "scan", "--json", "--db", str(db), *paths], env=env)
    return t.wall, t.rss_mib, json.loads(t.stdout)


def _startup(tmp: Path, env: dict[str, str] | None = None) -> float:
    empty = tmp / "empty"
    empty.mkdir(exist_ok=True)
    wall, _, _ = _scan_once([str(empty)], tmp / "startup.db", env)
    return wall


def _grep(files: list[Path]) -> float:
    return timed(["grep", "-E", "-c", "-i", GREP, *map(str, files)], timeout=120).wall


def throughput(
    files: list[Path],
    roots: list[Path],
    size: int,
    runs: int,
    tmp: Path,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Median MB/s of scan (start-up subtracted) and grep, alternating; the last summary."""
    _grep(files)  # page cache warm for both
    scans, greps, starts, ratios, rss = [], [], [], [], []
    summary: dict[str, Any] = {}
    for _ in range(runs):
        g = _grep(files)
        s0 = _startup(tmp, env)
        wall, peak, summary = _scan_once([str(r) for r in roots], tmp / "scan.db", env)
        work = max(wall - s0, 1e-3)
        greps.append(size / 1e6 / g)
        scans.append(size / 1e6 / work)
        starts.append(s0)
        ratios.append((size / work) / (size / g))
        rss.append(peak)
    return {
        "mb": round(size / 1e6, 1),
        "scan_mb_s": round(median(scans), 1),
        "scan_spread": round(spread(scans), 2),
        "grep_mb_s": round(median(greps), 1),
        "grep_spread": round(spread(greps), 2),
        "ratio": round(median(ratios), 3),
        "startup_s": round(median(starts), 3),
        "scan_s": round(size / 1e6 / median(scans), 2),
        "rss_mib": round(median(rss), 1),
        "runs": runs,
        "work_s": round(size / 1e6 / median(scans), 3),
        "summary": summary,
    }


def _pure(logs: Any, res: dict[str, Any], runs: int, tmp: Path) -> dict[str, Any]:
    """The same input in pure Python (``NANWATCH_PURE=1``), for the side-by-side figures."""
    got = throughput(logs.files, [logs.root], logs.bytes, runs, tmp, {PURE_ENV: "1"})
    summary = got.pop("summary")
    got["metrics_ok"] = summary["metrics"] == logs.iteration_lines
    got["us_per_line"] = round(got["work_s"] / max(logs.iteration_lines, 1) * 1e6, 2)
    return got


def run(mb: float, runs: int, plog_mb: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="nanwatch-bench-scan-"))
    try:
        compiled, detail = status()
        out: dict[str, Any] = {"core": f"compiled ({detail})" if compiled else f"pure ({detail})"}
        # 705-byte iteration lines (half and full size: growth), then ~300-byte ones
        sizes = {"half": (mb / 2, False), "full": (mb, False), "short": (mb, True)}
        for name, (m, short) in sizes.items():
            logs = mmengine_logs(tmp / name, m, short=short)
            res = throughput(logs.files, [logs.root], logs.bytes, runs, tmp)
            summary = res.pop("summary")
            found = sorted(
                (i["kind"], i["origin"].get("rank"))
                for i in summary["incidents"]
                if i["status"] != "merged"
            )
            res["incidents"] = found
            res["incidents_ok"] = found == sorted(logs.expected)
            res["metrics"] = summary["metrics"]
            res["iteration_lines"] = logs.iteration_lines
            res["metrics_ok"] = summary["metrics"] == logs.iteration_lines
            res["line_bytes"] = round(logs.bytes / max(logs.iteration_lines, 1))
            res["us_per_line"] = round(res["work_s"] / max(logs.iteration_lines, 1) * 1e6, 2)
            if name != "half":
                res["pure"] = _pure(logs, res, runs, tmp)
            out[name] = res
            shutil.rmtree(tmp / name)
        half, full = out["half"], out["full"]
        out["growth_time"] = round(full["scan_s"] / half["scan_s"], 2)
        out["growth_rss"] = round(full["rss_mib"] / half["rss_mib"], 2)
        files, size = plogs(tmp / "plog", plog_mb)
        res = throughput(files, [tmp / "plog"], size, runs, tmp)
        summary = res.pop("summary")
        res["incidents"] = sorted({i["kind"] for i in summary["incidents"]})
        res["events"] = summary["events"]
        res["incidents_ok"] = res["incidents"] == ["comm_timeout"]
        out["plog"] = res
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
