"""msprobe training-monitor output: readers that yield the same events as the rule packs.

``sources.monitor`` recognises monitor files by place and name; ``rows`` reads one CSV row,
``csvrows`` walks a chunk of them, ``dump`` reads anomaly.json, ``names`` maps tensor names to
modules, ``volume`` bounds how many findings become events, and ``reader`` ties them to the
pipeline's streams. Names load on first use (the correlator only needs ``names``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ...sources.monitor import MonitorFile, classify
    from .reader import MonitorReader

__all__ = ["MonitorFile", "MonitorReader", "classify"]

_EXPORTS = {
    "MonitorFile": "...sources.monitor",
    "classify": "...sources.monitor",
    "MonitorReader": ".reader",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
