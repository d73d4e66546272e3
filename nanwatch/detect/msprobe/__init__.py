"""msprobe training-monitor output: readers that yield the same events as the rule packs.

``sources.monitor`` recognises monitor files by place and name; ``rows`` reads one CSV row,
``csvrows`` walks a chunk of them, ``dump`` reads anomaly.json, ``names`` maps tensor names to
modules, ``volume`` bounds how many findings become events, and ``reader`` ties them to the
pipeline's streams.
"""

from ...sources.monitor import MonitorFile, classify
from .reader import MonitorReader

__all__ = ["MonitorFile", "MonitorReader", "classify"]
