"""What the store hands out: frozen records, one per table family, never rows or dicts.

Every reader in ``nanwatch.store`` returns these and every writer takes them (or the detect
stage's ``Event``/``Metric``), so the stages above the store see typed values and a second
backend only has to build the same records. JSON columns (``fields``, ``facts``, ``origin``,
``detail``, ``payload``) stay mappings of JSON values: their keys are open by design (rule
packs and knowledge entries add their own), which is the one place ``Any`` is honest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from .._dc import dataclass

JSON = Any  # a decoded JSON value: its shape is the rule pack's or the knowledge entry's

__all__ = [
    "EVENT_COLUMNS",
    "INCIDENT_COLUMNS",
    "JSON",
    "RUN_COLUMNS",
    "EventPlace",
    "EventRow",
    "FileHealth",
    "Incident",
    "IncidentRow",
    "Message",
    "MessageRef",
    "MetricRow",
    "OutboxRow",
    "Outcome",
    "Queued",
    "Run",
    "RunSummary",
    "Silence",
    "Source",
    "StoredEvent",
    "TimelineRow",
    "columns",
    "loads",
]


def loads(text: str | bytes | None, default: JSON) -> JSON:
    """A JSON column's value; ``default`` for NULL, empty or damaged text (never raises)."""
    if not text:
        return default
    try:
        return json.loads(text)
    except ValueError:
        return default


EVENT_COLUMNS = (
    "id, kind, time, ingested_at, run_id, source_id, offset, key, line, rank, local_rank, node, "
    "epoch, iter, step, stage, device, message, fields, incident_id"
)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One stored detection (the ``events`` table), as every stage above the store sees it."""

    id: int
    kind: str
    time: str | None
    ingested_at: str
    run_id: int | None
    source_id: int | None
    offset: int
    key: str
    line: int | None
    rank: int | None
    local_rank: int | None
    node: str | None
    epoch: int | None
    iter: int | None
    step: int | None
    stage: str | None
    device: str | None
    message: str
    fields: Mapping[str, JSON] = field(default_factory=dict)
    incident_id: int | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> StoredEvent:
        """From a row selected with ``EVENT_COLUMNS`` in that order."""
        (id_, kind, time, ingested, run_id, source_id, offset, key, line, rank, local_rank, node,
         epoch, iter_, step, stage, device, message, fields, incident_id) = row  # fmt: skip
        return cls(
            id=int(id_),
            kind=str(kind),
            time=time,
            ingested_at=str(ingested),
            run_id=run_id,
            source_id=source_id,
            offset=int(offset),
            key=str(key or ""),
            line=line,
            rank=rank,
            local_rank=local_rank,
            node=node,
            epoch=epoch,
            iter=iter_,
            step=step,
            stage=stage,
            device=device,
            message=str(message),
            fields=loads(fields, {}),
            incident_id=incident_id,
        )


RUN_COLUMNS = (
    "id, name, root, launch, experiment, job, node, created_at, first_time, last_time, facts, "
    "cluster_run"
)
INCIDENT_COLUMNS = (
    "id, run_id, kind, key, title, status, severity, ranks, first_time, last_time, event_count, "
    "origin, hints, detail, root_event_id, version, created_at, updated_at, resolved_at, "
    "acked_by, acked_at, ack_note, resolved_by, resolve_note"
)


def columns(names: str, alias: str) -> str:
    """``names`` (one of the ``*_COLUMNS`` lists) qualified by a table alias for joins."""
    return ", ".join(f"{alias}.{c.strip()}" for c in names.split(","))


@dataclass(frozen=True, slots=True)
class Run:
    """One launch of a training job on this node (the ``runs`` table)."""

    id: int
    name: str
    root: str
    launch: str
    experiment: str | None
    job: str | None
    node: str | None
    created_at: str
    first_time: str | None
    last_time: str | None
    facts: Mapping[str, JSON] = field(default_factory=dict)
    cluster_run: str | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Run:
        """From a row selected with ``RUN_COLUMNS`` in that order."""
        (id_, name, root, launch, experiment, job, node, created, first, last, facts,
         cluster_run) = row  # fmt: skip
        return cls(
            id=int(id_),
            name=str(name),
            root=str(root),
            launch=str(launch or ""),
            experiment=experiment,
            job=job,
            node=node,
            created_at=str(created),
            first_time=first,
            last_time=last,
            facts=loads(facts, {}),
            cluster_run=cluster_run,
        )


@dataclass(frozen=True, slots=True)
class Incident:
    """One incident (the ``incidents`` table): its lifecycle, origin, hints and details."""

    id: int
    run_id: int | None
    kind: str
    key: str
    title: str
    status: str
    severity: str
    ranks: tuple[int, ...]
    first_time: str | None
    last_time: str | None
    event_count: int
    origin: Mapping[str, JSON]
    hints: tuple[JSON, ...]
    detail: Mapping[str, JSON]
    root_event_id: int | None
    version: int
    created_at: str
    updated_at: str
    resolved_at: str | None
    acked_by: str | None = None
    acked_at: str | None = None
    ack_note: str | None = None
    resolved_by: str | None = None
    resolve_note: str | None = None

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Incident:
        """From a row selected with ``INCIDENT_COLUMNS`` in that order."""
        (id_, run_id, kind, key, title, status, severity, ranks, first, last, count, origin,
         hints, detail, root, version, created, updated, resolved, acked_by, acked_at, ack_note,
         resolved_by, resolve_note) = row  # fmt: skip
        return cls(
            id=int(id_),
            run_id=run_id,
            kind=str(kind),
            key=str(key),
            title=str(title),
            status=str(status),
            severity=str(severity),
            ranks=tuple(loads(ranks, [])),
            first_time=first,
            last_time=last,
            event_count=int(count or 0),
            origin=loads(origin, {}),
            hints=tuple(loads(hints, [])),
            detail=loads(detail, {}),
            root_event_id=root,
            version=int(version or 0),
            created_at=str(created),
            updated_at=str(updated),
            resolved_at=resolved,
            acked_by=acked_by,
            acked_at=acked_at,
            ack_note=ack_note,
            resolved_by=resolved_by,
            resolve_note=resolve_note,
        )


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One notification waiting in (or delivered from) the outbox."""

    id: int
    incident_id: int | None
    sink: str
    action: str
    payload: Mapping[str, JSON]
    dedup_key: str
    created_at: str
    due_at: float
    attempts: int
    last_error: str | None
    delivered_at: str | None


@dataclass(frozen=True, slots=True)
class Message:
    """Where a sink posted an incident's living message (Slack channel and ts)."""

    incident_id: int
    sink: str
    channel: str | None
    ts: str | None
    thread_ts: str | None
    posted_at: str
    updated_at: str | None


@dataclass(frozen=True, slots=True)
class Silence:
    """A silence: no notification for a run and/or kind until ``until`` (epoch seconds)."""

    id: int
    run: str | None
    kind: str | None
    until: float
    created_at: str
    comment: str | None


@dataclass(frozen=True, slots=True)
class Source:
    """One generation of one followed file and its committed offset (the ``sources`` table).

    ``id`` is None until the store has the row; ``ctx`` is the stream state at ``offset``
    (JSON text: the sources stage owns its shape)."""

    id: int | None
    run_id: int | None
    path: str
    root: str  # the configured PATH spec the file was found under
    dev: int
    ino: int
    gen: int
    offset: int
    head_hash: str | None
    head_len: int
    tail_hash: str | None
    cutting: bool
    lines_cut: int
    status: str
    ctx: str | None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run as the read commands list it: the run, what its rows count, and its span."""

    run: Run
    sources: int
    events: int
    incidents: int
    open_incidents: int
    nodes: tuple[str, ...]  # every node whose files fed it (a merged database), else its own
    first_time: str | None  # its logged span; what its rows say for databases that kept none
    last_time: str | None

    @property
    def status(self) -> str:
        """``failing`` while an incident is open, ``resolved`` when all are, else ``ok``."""
        return "failing" if self.open_incidents else "resolved" if self.incidents else "ok"


@dataclass(frozen=True, slots=True)
class EventRow:
    """A stored event with the names the read side shows for its ids: run name, file path."""

    event: StoredEvent
    run: str | None
    file: str | None


@dataclass(frozen=True, slots=True)
class IncidentRow:
    """An incident with the run it belongs to (None when its run is gone)."""

    incident: Incident
    run: Run | None


@dataclass(frozen=True, slots=True)
class TimelineRow:
    """One line of an incident's timeline: a rank's events of one kind (on one node)."""

    rank: int | None
    kind: str
    count: int
    first_time: str | None
    last_time: str | None
    first_step: int | None
    last_step: int | None
    node: str | None


@dataclass(frozen=True, slots=True)
class FileHealth:
    """What a database file says about itself (``doctor``); ``check`` is ``ok`` or the error."""

    check: str
    journal: str
    auto_vacuum: int
    version: int
    page_size: int
    pages: int
    free: int


@dataclass(frozen=True, slots=True)
class MessageRef:
    """Where a sink put an incident's message (``ts`` None: a webhook, nothing to edit)."""

    channel: str | None
    ts: str | None = None
    thread_ts: str | None = None


@dataclass(frozen=True, slots=True)
class Queued:
    """A notification to queue; a second one with the same ``dedup_key`` is ignored."""

    incident_id: int | None
    sink: str
    action: str
    payload: Mapping[str, JSON]
    dedup_key: str
    due_at: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a sender decided about one outbox row: delivered (``ok``, with the message it
    posted and the follow-up actions to queue), held until ``retry_at`` (``deferred``), retried
    at ``retry_at``, or given up (``permanent``)."""

    row_id: int
    ok: bool
    error: str | None = None
    retry_at: float | None = None
    permanent: bool = False
    message: MessageRef | None = None
    deferred: bool = False
    then: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EventPlace:
    """Where an event's bytes are: its source file (and that file's identity) and offset."""

    path: str
    line: int | None
    dev: int
    ino: int
    offset: int


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One logged iteration's numbers as stored (``nanwatch metrics``), with its run's name."""

    run: str | None
    run_id: int | None
    source_id: int | None
    offset: int
    rank: int | None
    step: int | None
    epoch: int | None
    iter: int | None
    stage: str | None
    time: str | None
    loss: float | None = None
    grad_norm: float | None = None
    step_time: float | None = None
    data_time: float | None = None
    lr: float | None = None
    memory: float | None = None
