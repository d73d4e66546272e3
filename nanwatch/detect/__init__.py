"""Stage 2: detection. Rule packs (``parsers/*.toml``) turn lines into events and metrics."""

from ..stream import StreamState
from .engine import Detector
from .rules import RuleSet, load_rules

__all__ = ["Detector", "RuleSet", "StreamState", "load_rules"]
