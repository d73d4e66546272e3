"""An incident as the renderers (console, Slack, Alertmanager) and the CLI's JSON see it.

The store hands out an :class:`Incident` and its :class:`Run`; ``query.incident_view`` builds
the vocabulary of ARCHITECTURE.md from them, key for key what ``nanwatch show --json`` prints
(one function for both sides).
"""

from __future__ import annotations

from ..query import incident_view
from ..store.outbox import OutboxStore
from ..store.records import JSON

__all__ = ["incident_view", "load_incident"]


def load_incident(db: OutboxStore, incident_id: int) -> dict[str, JSON] | None:
    """The incident's JSON form read from the store (None: it is gone)."""
    got = db.incident(incident_id)
    return None if got is None else incident_view(*got)
