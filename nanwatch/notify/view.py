"""An incident as the renderers (console, Slack, Alertmanager) and the CLI's JSON see it.

The store hands out an :class:`Incident` and its :class:`Run`; this is the vocabulary of
ARCHITECTURE.md built from them, key for key what ``nanwatch show --json`` prints.
"""

from __future__ import annotations

from ..store.outbox import OutboxStore
from ..store.records import JSON, Incident, Run


def incident_view(inc: Incident, run: Run | None) -> dict[str, JSON]:
    """The incident's JSON form (a mapping of JSON values: what renderers format)."""
    detail = dict(inc.detail)
    node = run.node if run else None
    # where its events were read: one node, or several in a merged database
    nodes = detail.get("nodes") or ([node] if node else [])
    return {
        "id": inc.id,
        "kind": inc.kind,
        "title": inc.title,
        "status": inc.status,
        "run": run.name if run else None,
        "experiment": run.experiment if run else None,
        "ranks": list(inc.ranks),
        "first_time": inc.first_time,
        "last_time": inc.last_time,
        "event_count": inc.event_count,
        "origin": dict(inc.origin),
        "hints": list(inc.hints),
        "severity": inc.severity,
        "detail": detail,
        "created_at": inc.created_at,
        "updated_at": inc.updated_at,
        "resolved_at": inc.resolved_at,
        "version": inc.version,
        "node": node,
        "job": run.job if run else None,
        "cluster_run": run.cluster_run if run else None,
        "nodes": sorted(str(n) for n in nodes),
        # people's part: `nanwatch ack` / `nanwatch resolve` (None until someone does)
        "acked_by": inc.acked_by,
        "acked_at": inc.acked_at,
        "ack_note": inc.ack_note,
        "resolved_by": inc.resolved_by,
        "resolve_note": inc.resolve_note,
        # why it was resolved: the person's note, or what nanwatch saw
        "resolution": inc.resolve_note if inc.resolved_by else detail.get("resolution"),
    }


def load_incident(db: OutboxStore, incident_id: int) -> dict[str, JSON] | None:
    """The incident's JSON form read from the store (None: it is gone)."""
    got = db.incident(incident_id)
    return None if got is None else incident_view(*got)
