"""Stage 2: detection. Rule packs (``parsers/*.toml``) turn lines into events and metrics.

Names load on first use: a submodule (``detect.msprobe.names`` for the correlator, ``detect.rules``
for `nanwatch rules`) does not pull the whole engine in with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from ..stream import StreamState
    from .engine import Detector
    from .rules import RuleSet, load_rules

__all__ = ["Detector", "RuleSet", "StreamState", "load_rules"]

_EXPORTS = {
    "Detector": ".engine",
    "RuleSet": ".rules",
    "load_rules": ".rules",
    "StreamState": "..stream",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
