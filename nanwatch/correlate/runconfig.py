"""What a run's own config file says, for filling hints: which file it is, the training
annotation file and the classes.

mmengine's Runner dumps the config it ran with into the work_dir, under the config's own name
(``work_dirs/dino-4scale_r50_8xb2-12e_coco/dino-4scale_r50_8xb2-12e_coco.py``), and again as
``<timestamp>/vis_data/config.py``. The dump is plain Python literals, read here with regexes,
never executed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_MAX = 1 << 20  # a config dump is a few KB; anything larger is not one
_TRAIN = re.compile(r"^train_dataloader\s*=", re.M)
_NEXT_TOP = re.compile(r"^\w+\s*=", re.M)
_ANN = re.compile(r"""ann_file\s*=\s*['"]([^'"]+)['"]""")
_ROOT = re.compile(r"""data_root\s*=\s*['"]([^'"]*)['"]""")
_CLASSES = re.compile(r"""classes\s*=\s*[\(\[]([^\)\]]*)[\)\]]""")
_NAME = re.compile(r"""['"]([^'"]+)['"]""")


def config_file(work_dir: str | None, experiment: str | None, launch: str | None) -> Path | None:
    """The config file the run's work_dir holds, if there is one."""
    if not work_dir:
        return None
    candidates = []
    if experiment:
        candidates.append(Path(work_dir) / f"{Path(experiment).name}.py")
    if launch:
        candidates.append(Path(work_dir) / launch / "vis_data" / "config.py")
    for c in candidates:
        try:
            if c.is_file() and c.stat().st_size <= _MAX:
                return c
        except OSError:
            continue
    return None


def config_values(path: Path) -> dict[str, str]:
    """``annotations`` (the training ann_file joined to its data_root) and ``classes`` (comma
    separated), when the config names them."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    out: dict[str, str] = {}
    m = _TRAIN.search(text)
    if m:
        rest = text[m.end() :]
        end = _NEXT_TOP.search(rest)
        section = rest[: end.start()] if end else rest
        ann = _ANN.search(section)
        if ann:
            root = _ROOT.search(section) or _ROOT.search(text)
            base = root.group(1) if root else ""
            # a relative path is relative to where training started: kept as the config says
            out["annotations"] = os.path.join(base, ann.group(1)) if base else ann.group(1)
    c = _CLASSES.search(text)
    if c:
        names = _NAME.findall(c.group(1))
        if names:
            out["classes"] = ",".join(names)
    return out
