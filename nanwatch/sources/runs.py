"""Which run a file belongs to (ARCHITECTURE.md, "run").

Each PATH is one run, unless it holds several launches of the same kind, which then split:
mmengine timestamp folders (``work_dir/20261130_101500/``), msprobe monitor folders
(``{MonDD_HH-MM-SS}-rank{R}-{id}``) whose start times are minutes apart. Files without a marker
join their PATH's run. The experiment is what runs of the same work share (the mmengine work_dir).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .._dc import dataclass
from .discover import Root
from .monitor import RANK_DIR, classify, folder_time

_MMENGINE_TS = re.compile(r"^\d{8}_\d{6}$")


@dataclass(frozen=True)
class RunKey:
    root: str  # the PATH (absolute) the run belongs to
    launch: str  # launch marker below it ('' for the PATH itself)
    name: str  # proposed display name
    experiment: str | None


def run_key(root: Root, path: str) -> RunKey:
    base = root.base if root.kind != "file" else os.path.dirname(root.path)
    root_name = _root_name(root)
    experiment: str | None = None
    # the PATH itself is a launch folder: its parent is the experiment (work_dir)
    own = os.path.basename(root.path.rstrip("/")) if root.kind == "dir" else ""
    if _MMENGINE_TS.match(own):
        experiment = os.path.basename(os.path.dirname(root.path.rstrip("/"))) or None
        return RunKey(root.path, "", f"{experiment}/{own}" if experiment else own, experiment)
    rel = Path(os.path.relpath(path, base)).parts[:-1]
    for i, part in enumerate(rel):
        if _MMENGINE_TS.match(part):
            parent = rel[i - 1] if i > 0 else root_name
            launch = "/".join(rel[: i + 1])
            return RunKey(root.path, launch, f"{root_name}/{launch}", parent)
    if root.kind != "file":
        found = _msprobe_folder_run(root, base, rel, root_name)
        if found is not None:
            return found
    # A file beside launch folders (mmengine's config dump `20261130_101500.py`,
    # `last_checkpoint`) belongs to the launch its name carries, else to the newest one.
    sibling = _launch_beside(path)
    if sibling is not None and root.kind != "file":
        folder = os.path.dirname(path)
        launch = "/".join([*rel, sibling]) if rel else sibling
        parent = os.path.basename(folder) or root_name
        return RunKey(root.path, launch, f"{root_name}/{launch}", parent)
    if root.kind != "file":
        found = _msprobe_unmarked_run(root, base, rel, path, root_name)
        if found is not None:
            return found
    return RunKey(root.path, "", root_name, experiment)


def _launch_beside(path: str) -> str | None:
    folder = os.path.dirname(path)
    try:
        launches = sorted(
            e.name for e in os.scandir(folder) if e.is_dir() and _MMENGINE_TS.match(e.name)
        )
    except OSError:
        return None
    if not launches:
        return None
    name = os.path.basename(path)
    for launch in launches:
        if launch in name:
            return launch
    return launches[-1]


def _root_name(root: Root) -> str:
    if root.kind == "file":
        name = os.path.basename(root.path)
        stem, dot, ext = name.rpartition(".")
        return stem if dot and stem and ext in ("log", "txt", "out", "err") else name
    if root.kind == "glob":
        return os.path.basename(root.base.rstrip("/")) or "runs"
    return os.path.basename(root.path.rstrip("/")) or "root"


# -- msprobe monitor folders -------------------------------------------------------------------

# Ranks of one launch create their folders within seconds; a restart takes minutes, and a rank
# that appears twice is a second launch whatever the gap.
LAUNCH_GAP = 120.0
_CACHE_TTL = 10.0
_clusters_cache: dict[str, tuple[int, list[tuple[float, str]]]] = {}
_monitor_dirs_cache: dict[str, tuple[float, list[str]]] = {}


def launch_clusters(folder: str) -> list[tuple[float, str]]:
    """The launches among a monitor output folder's rank folders: (start time, first folder)."""
    try:
        mtime = os.stat(folder).st_mtime_ns
    except OSError:
        return []
    hit = _clusters_cache.get(folder)
    if hit is not None and hit[0] == mtime:
        return hit[1]
    found: list[tuple[float, int, str]] = []
    try:
        for e in os.scandir(folder):
            m = RANK_DIR.match(e.name)
            if not m or not e.is_dir():
                continue
            t = folder_time(e.name, e.stat().st_mtime)
            if t is not None:
                found.append((t, int(m["rank"]), e.name))
    except OSError:
        return []
    found.sort()
    out: list[tuple[float, str]] = []
    last = -1e18
    ranks: set[int] = set()
    for t, rank, name in found:
        if t - last > LAUNCH_GAP or rank in ranks:
            out.append((t, name))
            ranks = set()
        ranks.add(rank)
        last = t
    _clusters_cache[folder] = (mtime, out)
    return out


def _launch_of(folder: str, name: str) -> int:
    try:
        t = folder_time(name, os.stat(os.path.join(folder, name)).st_mtime)
    except OSError:
        t = None
    clusters = launch_clusters(folder)
    idx = 0
    for i, (start, _) in enumerate(clusters):
        if t is not None and t >= start:
            idx = i
    return idx


def _msprobe_folder_run(
    root: Root, base: str, rel: tuple[str, ...], root_name: str
) -> RunKey | None:
    """The run of a file in an msprobe rank folder; None for files outside them.

    The first launch of a monitor folder is the PATH's run (so a PATH holding one launch's
    monitor output and its stdout log is one run); later launches split off.
    """
    for i, part in enumerate(rel):
        if not RANK_DIR.match(part):
            continue
        inside = _mmengine_above(root, base, rel[:i], root_name)
        if inside is not None:
            return inside
        folder = os.path.join(base, *rel[:i])
        idx = _launch_of(folder, part)
        key = _cluster_key(root, rel[:i], launch_clusters(folder), idx, root_name)
        return key or RunKey(root.path, "", root_name, None)
    return None


def _msprobe_unmarked_run(
    root: Root, base: str, rel: tuple[str, ...], path: str, root_name: str
) -> RunKey | None:
    """Files without a marker (stdout, anomaly dumps) beside several launches of msprobe go to
    the latest launch that started before they were last written."""
    if classify(path) is not None:  # anomaly dumps, module_struct.json
        inside = _mmengine_above(root, base, rel, root_name)
        if inside is not None:
            return inside
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        return None
    for folder in _monitor_dirs(base):
        clusters = launch_clusters(folder)
        if len(clusters) < 2:
            continue
        idx = max((k for k, (start, _) in enumerate(clusters) if start <= mtime + 60), default=0)
        sub = tuple(Path(os.path.relpath(folder, base)).parts) if folder != base else ()
        return _cluster_key(root, sub, clusters, idx, root_name)
    return None


def _mmengine_above(root: Root, base: str, rel: tuple[str, ...], root_name: str) -> RunKey | None:
    """Monitor output inside an mmengine work_dir belongs to its (newest) launch, like the rest."""
    for j in range(len(rel), -1, -1):
        sibling = _launch_in(os.path.join(base, *rel[:j]))
        if sibling is not None:
            launch = "/".join([*rel[:j], sibling])
            return RunKey(
                root.path, launch, f"{root_name}/{launch}", rel[j - 1] if j else root_name
            )
    return None


def _cluster_key(
    root: Root, sub: tuple[str, ...], clusters: list[tuple[float, str]], idx: int, root_name: str
) -> RunKey | None:
    if idx == 0 or idx >= len(clusters):
        return None
    stamp = RANK_DIR.match(clusters[idx][1])
    ts = stamp["ts"] if stamp else clusters[idx][1]
    launch = "/".join([*sub, ts])
    return RunKey(root.path, launch, f"{root_name}/{ts}", None)


def _launch_in(folder: str) -> str | None:
    try:
        launches = sorted(
            e.name for e in os.scandir(folder) if e.is_dir() and _MMENGINE_TS.match(e.name)
        )
    except OSError:
        return None
    return launches[-1] if launches else None


def _monitor_dirs(base: str, depth: int = 3, limit: int = 5000) -> list[str]:
    """Folders below ``base`` that hold msprobe rank folders (cached briefly)."""
    now = time.monotonic()
    hit = _monitor_dirs_cache.get(base)
    if hit is not None and now - hit[0] < _CACHE_TTL:
        return hit[1]
    out: list[str] = []
    stack = [(base, 0)]
    seen = 0
    while stack and seen < limit:
        d, level = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        holds = False
        for e in entries:
            seen += 1
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
            except OSError:
                continue
            if RANK_DIR.match(e.name):
                holds = True
            elif level < depth:
                stack.append((e.path, level + 1))
        if holds:
            out.append(d)
    _monitor_dirs_cache[base] = (now, sorted(out))
    return sorted(out)
