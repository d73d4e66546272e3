"""Environment facts the knowledge base needs: versions (CANN, torch, ...) and how to find them.

The CANN version comes from ``[knowledge] cann_version``, the run's facts (printed by the job),
or this node's ascend-toolkit install files; a fact nobody knows stays unknown and hints say how
to find it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

# what to run to find a version (the first command on the node that ran the job)
HOW_TO_FIND: dict[str, tuple[str, ...]] = {
    "cann": (
        "cat $ASCEND_TOOLKIT_HOME/version.cfg",
        "npu-smi info",
        "python -c 'import torch_npu; print(torch_npu.version.cann)'",
    ),
    "torch": ("python -c 'import torch; print(torch.__version__)'",),
    "torch_npu": ("python -c 'import torch_npu; print(torch_npu.__version__)'",),
    "mmengine": ("python -c 'import mmengine; print(mmengine.__version__)'",),
    "mmdet": ("python -c 'import mmdet; print(mmdet.__version__)'",),
    "msprobe": ("pip show mindstudio-probe",),
}
LABELS = {"cann": "CANN", "torch_npu": "torch_npu", "mmengine": "mmengine", "mmdet": "mmdet"}

_TOOLKIT_DIRS = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/latest",
    "/usr/local/Ascend/cann",
)
_INFO_VERSION = re.compile(r"^\s*version\s*=\s*([0-9][\w.]*)\s*$", re.M)
_CFG_VERSION = re.compile(r"running_version=\[[^:\]]*:([0-9][\w.]*)\]")


def node_cann_version(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(version, where it was read) from this node's ascend-toolkit install, if any."""
    env = os.environ if environ is None else environ
    homes = [env.get("ASCEND_TOOLKIT_HOME"), env.get("ASCEND_HOME_PATH"), *_TOOLKIT_DIRS]
    for home in homes:
        if not home:
            continue
        base = Path(home)
        candidates = [
            base / "version.cfg",
            *sorted(base.glob("*-linux/ascend_toolkit_install.info")),
        ]
        for f in candidates:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            m = _INFO_VERSION.search(text) or _CFG_VERSION.search(text)
            if m:
                return m.group(1), str(f)
    return None, None


def version_key(v: str) -> tuple[tuple[int, ...], tuple[int, int]]:
    """Order versions like CANN and Python packages: 8.0.RC2 < 8.0.0 < 8.0.1; 2.1.0a0 < 2.1.0.

    Release numbers, then the pre-release (alpha < beta < RC < final); local parts (``+cpu``)
    and build suffixes after a pre-release are ignored.
    """
    release: list[int] = []
    pre: tuple[int, int] = (9, 0)  # a final release sorts after its pre-releases
    for tok in re.split(r"[.\-]", v.strip().lower().split("+", 1)[0]):
        if not tok:
            continue
        if tok.isdigit():
            release.append(int(tok))
            continue
        m = re.fullmatch(r"(\d+)([a-z]+)(\d*)", tok)
        if m:
            release.append(int(m.group(1)))
            pre = (_pre(m.group(2)), int(m.group(3) or 0))
            break
        m = re.fullmatch(r"([a-z]+)(\d*)", tok)
        if m:
            pre = (_pre(m.group(1)), int(m.group(2) or 0))
            break
        break
    padded = tuple(release + [0] * (6 - len(release)))[:6]
    return (padded, pre)


def _pre(tag: str) -> int:
    return {"a": 0, "alpha": 0, "t": 0, "b": 1, "beta": 1, "rc": 2, "spc": 10}.get(tag, 3)


_CONSTRAINT = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*([0-9][\w.+-]*)\s*$")


def satisfies(version: str, constraint: str) -> bool:
    """``satisfies("8.0.RC1", "<8.0.0")`` -> True. Several constraints: comma-separated (AND)."""
    for part in constraint.split(","):
        m = _CONSTRAINT.match(part)
        if not m:
            raise ValueError(f"not a version constraint: {part!r} (use e.g. <8.0.0)")
        op, ref = m.groups()
        a, b = version_key(version), version_key(ref)
        ok = {
            "<": a < b,
            "<=": a <= b,
            ">": a > b,
            ">=": a >= b,
            "==": a == b,
            "!=": a != b,
        }[op]
        if not ok:
            return False
    return True
