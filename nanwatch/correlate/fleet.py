"""The fleet correlator's cycle: pull what nodes forwarded, correlate it as one node would.

The fleet store (PostgreSQL) holds every node's events; the working database (SQLite, the
node schema) holds them pulled, with sources keyed by node. The same ``Correlator`` that runs on
a node then sees one launch across all nodes: an OOM on node A absorbs node B's timeouts, the
first NaN is the first across every rank. It works incrementally: each cycle reads only the
events pulled since the last one (the correlator's own cursor), never the whole fleet again.

A node that stopped forwarding (no heartbeat for ``SILENT_AFTER`` of its heartbeats) while
others time out is named as a suspect on the open communication incidents of that launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field

from .._dc import dataclass
from ..store.db import Store
from ..store.fleet import FleetStore
from ..store.fleet_work import import_events, import_lifecycles, pulled_upto
from ..store.merge import carry_over_resolutions
from .incidents import Change, Correlator

__all__ = ["SILENT_AFTER", "Cycle", "FleetCorrelator", "SilentNode", "silent_nodes"]

SILENT_AFTER = 3.0  # heartbeats missed before a node counts as silent
PULL_BATCH = 20000


@dataclass(frozen=True, slots=True)
class SilentNode:
    node: str
    host: str | None
    silent_for: float  # seconds since its last forward


@dataclass
class Cycle:
    """What one cycle did."""

    pulled: int = 0
    changes: list[Change] = field(default_factory=list)
    resolved: list[int] = field(default_factory=list)
    silent: list[SilentNode] = field(default_factory=list)
    nodes: int = 0

    @property
    def touched(self) -> list[int]:
        """Fleet incidents whose document must be published again."""
        return sorted({c.incident_id for c in self.changes} | set(self.resolved))


class FleetCorrelator:
    def __init__(self, fleet: FleetStore, work: Store, correlator: Correlator) -> None:
        self.fleet = fleet
        self.work = work
        self.correlator = correlator

    def cycle(self, *, now: float) -> Cycle:
        out = Cycle()
        while True:
            events = self.fleet.events_after(pulled_upto(self.work), limit=PULL_BATCH)
            if not events:
                break
            out.pulled += import_events(self.work, events)
        import_lifecycles(self.work, self.fleet.node_incidents())
        out.changes = self.correlator.process(live=False, now=now)
        out.resolved = [iid for iid, _ in carry_over_resolutions(self.work)]
        nodes = self.fleet.nodes()
        out.nodes = len(nodes)
        out.silent = silent_nodes(nodes, now=now)
        return out


def silent_nodes(
    nodes: Sequence[tuple[str, str | None, float, float, int]], *, now: float
) -> list[SilentNode]:
    """Nodes whose last forward is older than ``SILENT_AFTER`` of their own heartbeats."""
    return [
        SilentNode(node, host, round(now - last, 1))
        for node, host, last, every, _ in nodes
        if now - last > SILENT_AFTER * every
    ]
