"""Which run a file belongs to (ARCHITECTURE.md, "run").

Each PATH is one run, unless it holds several launches of the same kind, which then split:
mmengine timestamp folders (``work_dir/20261130_101500/``). Files without a marker join their
PATH's run. The experiment is what runs of the same work share (the mmengine work_dir).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .discover import Root

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
    # A file beside launch folders (mmengine's config dump `20261130_101500.py`,
    # `last_checkpoint`) belongs to the launch its name carries, else to the newest one.
    sibling = _launch_beside(path)
    if sibling is not None and root.kind != "file":
        folder = os.path.dirname(path)
        launch = "/".join([*rel, sibling]) if rel else sibling
        parent = os.path.basename(folder) or root_name
        return RunKey(root.path, launch, f"{root_name}/{launch}", parent)
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
