"""nanwatch: watches distributed training runs for NaNs, OOMs, collective timeouts and slowdowns.

The public surface for scripts is what ``__all__`` lists; everything else may change. Names are
imported on first use, so ``import nanwatch`` (and the CLI's ``--help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "config",
    "load_config": "config",
    "Detector": "detect",
    "RuleSet": "detect",
    "load_rules": "detect",
    "StreamState": "stream",
    "NanwatchError": "errors",
    "ConfigError": "errors",
    "RuleError": "errors",
    "SourceError": "errors",
    "StoreError": "errors",
    "DeliveryError": "errors",
    "KINDS": "events",
    "Event": "events",
    "Metric": "events",
    "Pipeline": "daemon.pipeline",
    "Store": "store",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:  # pragma: no cover
    from .config import Config, load_config  # noqa: F401
    from .daemon.pipeline import Pipeline  # noqa: F401
    from .detect import Detector, RuleSet, load_rules  # noqa: F401
    from .errors import (  # noqa: F401
        ConfigError,
        DeliveryError,
        NanwatchError,
        RuleError,
        SourceError,
        StoreError,
    )
    from .events import KINDS, Event, Metric  # noqa: F401
    from .store import Store  # noqa: F401
    from .stream import StreamState  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanwatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
