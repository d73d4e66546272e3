"""The read side in the vocabulary of ARCHITECTURE.md: events, incidents and runs as the CLI's
JSON (and the tables and stories made from it) shows them.

The store hands out records (``nanwatch.store.reads``, ``nanwatch.store.runs``); this module
only names their fields the way ``--json`` always has, so that interface stays put while the
store changes underneath. Each function takes the Store (or, for callers written before it,
a bare reader connection).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .store.reads import Readable, Reads, as_store
from .store.records import JSON, EventRow, Incident, IncidentRow, Run, RunSummary, TimelineRow
from .store.runs import Runs

Doc = dict[str, JSON]  # one JSON object of the CLI's output


def event_doc(row: EventRow) -> Doc:
    e = row.event
    return {
        "id": e.id,
        "kind": e.kind,
        "time": e.time,
        "ingested_at": e.ingested_at,
        "run": row.run,
        "file": row.file,
        "line": e.line,
        "rank": e.rank,
        "local_rank": e.local_rank,
        "node": e.node,
        "epoch": e.epoch,
        "iter": e.iter,
        "step": e.step,
        "stage": e.stage,
        "device": e.device,
        "message": e.message,
        "fields": dict(e.fields),
        "incident": e.incident_id,
    }


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


def incident_doc(row: IncidentRow) -> Doc:
    """The incident's JSON form: the one the renderers and sinks get too."""
    return incident_view(row.incident, row.run)


def timeline_doc(t: TimelineRow) -> Doc:
    return {
        "rank": t.rank,
        "kind": t.kind,
        "count": t.count,
        "first_time": t.first_time,
        "last_time": t.last_time,
        "first_step": t.first_step,
        "last_step": t.last_step,
        "node": t.node,
    }


def run_doc(s: RunSummary) -> Doc:
    r = s.run
    return {
        "id": r.id,
        "name": r.name,
        "path": r.root,
        "launch": r.launch or None,
        "experiment": r.experiment,
        "job": r.job,
        "cluster_run": r.cluster_run,
        "node": r.node,
        # every node whose files fed the run (merged databases); else the run's node
        "nodes": list(s.nodes),
        "created_at": r.created_at,
        "sources": s.sources,
        "events": s.events,
        "incidents": s.incidents,
        "facts": dict(r.facts),
        "first_time": s.first_time,
        "last_time": s.last_time,
        "open_incidents": s.open_incidents,
        "status": s.status,
    }


def run_names(source: Readable) -> list[str]:
    return Runs(as_store(source)).names()


def iter_events(
    source: Readable,
    *,
    kind: str | None = None,
    run: str | None = None,
    runs: Sequence[str] | None = None,
    rank: int | None = None,
    incident: int | None = None,
    since: str | None = None,
    until: str | None = None,
    grep: str | None = None,
    limit: int | None = None,
    newest: bool = False,
) -> Iterator[Doc]:
    """Events oldest first (``newest``: the last ``limit`` ones, still printed oldest first).
    ``since``/``until`` are RFC 3339 UTC strings compared with the event's time (else the time
    it was read); ``grep``: words of the message, in order (full-text search)."""
    if run:
        runs = [run, *(runs or [])]
    rows = Reads(as_store(source)).events(
        kind=kind,
        runs=runs,
        rank=rank,
        incident=incident,
        since=since,
        until=until,
        grep=grep,
        limit=limit,
        newest=newest,
    )
    return (event_doc(r) for r in rows)


def list_incidents(
    source: Readable,
    *,
    open_only: bool = False,
    status: str | None = None,
    run: str | None = None,
    runs: Sequence[str] | None = None,
    kind: str | None = None,
    rank: int | None = None,
    since: str | None = None,
    until: str | None = None,
    limit: int | None = None,
    include_merged: bool = False,
) -> list[Doc]:
    """Incidents oldest first; those absorbed into another one (``merged``) only on request.
    ``since``/``until`` keep incidents whose span (first to last event) overlaps them;
    ``limit`` keeps the newest ones."""
    if run:
        runs = [run, *(runs or [])]
    rows = Reads(as_store(source)).incidents(
        status="open" if open_only else status,
        runs=runs,
        kind=kind,
        rank=rank,
        since=since,
        until=until,
        limit=limit,
        include_merged=include_merged,
    )
    return [incident_doc(r) for r in rows]


def incident_dict(source: Readable, incident_id: int) -> Doc | None:
    row = Reads(as_store(source)).incident(incident_id)
    return incident_doc(row) if row else None


def show_incident(
    source: Readable, incident_id: int, *, max_events: int | None = None
) -> Doc | None:
    """An incident with its events (oldest first) and per-rank timeline."""
    reads = Reads(as_store(source))
    row = reads.incident(incident_id)
    if row is None:
        return None
    inc = incident_doc(row)
    inc["events"] = [event_doc(e) for e in reads.events(incident=incident_id, limit=max_events)]
    inc["timeline"] = [timeline_doc(t) for t in reads.timeline(incident_id)]
    return inc


def list_runs(source: Readable) -> list[Doc]:
    return [run_doc(s) for s in Runs(as_store(source)).summaries()]
