"""Events as correlation reads and writes them: by id, by incident, by run and kind, after an
id; attaching them to incidents. Every reader returns ``StoredEvent`` records (or a small record
of its own below), never rows.

``MetricReads`` holds the few questions correlation asks of the logged iterations (a run's
recovery, a relaunch that trained past an incident, the steps before a NaN): kept apart so the
metrics module can answer them from its own storage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .._dc import dataclass
from .db import Store
from .records import EVENT_COLUMNS, JSON, StoredEvent

__all__ = [
    "Events",
    "KindGroup",
    "MetricReads",
    "SampleIssue",
    "Span",
    "TensorGroup",
]

# a tensor finding (msprobe CSV rows, anomaly dumps, alert lines) names how it was read
_TENSOR = 'fields LIKE \'%"via":"%\''


@dataclass(frozen=True, slots=True)
class Span:
    """What an incident's events add up to, counted afresh (after a merge moved events)."""

    count: int
    first_time: str | None
    last_time: str | None
    ranks: frozenset[int]
    nodes: frozenset[str]


@dataclass(frozen=True, slots=True)
class KindGroup:
    """An incident's events of one kind on one rank: how many, since when, what they name."""

    kind: str
    rank: int | None
    count: int
    first_time: str | None
    backends: tuple[str, ...]
    codes: tuple[str, ...]
    remote: tuple[str, ...]
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """The tensor findings of one (step, tag, rank) of an incident."""

    step: int
    tag: str | None
    rank: int | None
    count: int
    sampled: bool


@dataclass(frozen=True, slots=True)
class SampleIssue:
    """One training sample a run reported unusable (the first event of its duplicates)."""

    event_id: int
    rank: int | None
    epoch: int | None
    iter: int | None
    step: int
    reason: str | None
    image: JSON
    image_id: JSON
    time: str | None


def _split(joined: object) -> tuple[str, ...]:
    return tuple(x for x in str(joined).split(",") if x) if joined else ()


class Events:
    """The ``events`` table for the correlate stage (in the writer's transaction)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def _select(self, where: str, params: Sequence[object]) -> list[StoredEvent]:
        sql = f"SELECT {EVENT_COLUMNS} FROM events WHERE {where}"
        return [StoredEvent.from_row(r) for r in self._store._conn.execute(sql, params).fetchall()]

    # -- single events and lists -----------------------------------------------------------------

    def after(self, last_id: int, limit: int = 100000) -> list[StoredEvent]:
        """Events committed after ``last_id``, oldest first (what a pass correlates)."""
        return self._select("id > ? ORDER BY id LIMIT ?", (last_id, limit))

    def get(self, event_id: int) -> StoredEvent | None:
        found = self._select("id = ?", (event_id,))
        return found[0] if found else None

    def of_incident(
        self, incident_id: int, *, kind: str | None = None, limit: int | None = None
    ) -> list[StoredEvent]:
        """An incident's events in arrival order (of one kind; the first ``limit``)."""
        where = "incident_id = ?"
        params: list[object] = [incident_id]
        if kind is not None:
            where, params = where + " AND kind = ?", [*params, kind]
        if limit is not None:
            return self._select(where + " ORDER BY id LIMIT ?", [*params, limit])
        return self._select(where + " ORDER BY id", params)

    def earliest(self, incident_id: int, kinds: tuple[str, ...] = ()) -> StoredEvent | None:
        """The incident's first event by (step, time, rank, arrival): ``origin.sort_key``'s order
        in SQL, because an incident may hold thousands of events."""
        only = f" AND kind IN ({','.join('?' * len(kinds))})" if kinds else ""
        found = self._select(
            f"incident_id=?{only} ORDER BY step IS NULL, step, "
            "coalesce(time, json_extract(fields, '$.stream_time'), '~'), "
            "rank IS NULL, rank, id LIMIT 1",
            (incident_id, *kinds),
        )
        return found[0] if found else None

    def run_has_kind(self, run_id: int, kind: str) -> bool:
        row = self._store._conn.execute(
            "SELECT 1 FROM events WHERE run_id = ? AND kind = ? LIMIT 1", (run_id, kind)
        ).fetchone()
        return row is not None

    def comm_failures(self, run_id: int | None, rank: int | None) -> list[StoredEvent]:
        """The run's correlated communication failures on ``rank`` (any rank when None; those
        that name no rank, or name it as their local rank, too)."""
        return self._select(
            "run_id IS ? AND kind IN ('comm_timeout', 'comm_error') AND incident_id IS NOT NULL "
            "AND (? IS NULL OR rank IS NULL OR rank = ? OR local_rank = ?) ORDER BY id LIMIT 500",
            (run_id, rank, rank, rank),
        )

    # -- what an incident's events add up to -----------------------------------------------------

    def span(self, incident_id: int) -> Span:
        conn = self._store._conn
        count, first, last = conn.execute(
            "SELECT count(*), min(time), max(time) FROM events WHERE incident_id = ?",
            (incident_id,),
        ).fetchone()
        nodes = conn.execute(
            "SELECT DISTINCT node FROM events WHERE incident_id = ? AND node IS NOT NULL",
            (incident_id,),
        ).fetchall()
        return Span(
            int(count), first, last, self.ranks(incident_id), frozenset(n for (n,) in nodes)
        )

    def ranks(self, incident_id: int) -> frozenset[int]:
        rows = self._store._conn.execute(
            "SELECT DISTINCT rank FROM events WHERE incident_id = ? AND rank IS NOT NULL",
            (incident_id,),
        ).fetchall()
        return frozenset(r for (r,) in rows)

    def kinds(self, incident_id: int) -> list[str]:
        rows = self._store._conn.execute(
            "SELECT DISTINCT kind FROM events WHERE incident_id = ?", (incident_id,)
        ).fetchall()
        return [k for (k,) in rows]

    def composition(self, incident_id: int) -> list[KindGroup]:
        rows = self._store._conn.execute(
            "SELECT kind, rank, count(*), min(time), "
            "group_concat(DISTINCT json_extract(fields, '$.backend')), "
            "group_concat(DISTINCT json_extract(fields, '$.code')), "
            "group_concat(DISTINCT json_extract(fields, '$.remote_rank')), "
            "group_concat(DISTINCT node) "
            "FROM events WHERE incident_id = ? GROUP BY kind, rank",
            (incident_id,),
        ).fetchall()
        return [
            KindGroup(
                kind, rank, int(n), t0, _split(backends), _split(codes), _split(remote),
                _split(nodes),
            )
            for kind, rank, n, t0, backends, codes, remote, nodes in rows
        ]  # fmt: skip

    def backends_and_codes(self, incident_id: int) -> list[tuple[str, JSON, JSON]]:
        """(kind, fields.backend, fields.code), distinct, over the incident's events."""
        rows = self._store._conn.execute(
            "SELECT DISTINCT kind, json_extract(fields, '$.backend'), "
            "json_extract(fields, '$.code') FROM events WHERE incident_id = ?",
            (incident_id,),
        ).fetchall()
        return [(str(k), b, c) for k, b, c in rows]

    def named_peers(self, incident_id: int) -> list[tuple[JSON, int | None]]:
        """(fields.remote_rank, rank) of the incident's communication failures that name the
        peer they waited for, in arrival order."""
        rows = self._store._conn.execute(
            "SELECT json_extract(fields, '$.remote_rank'), rank FROM events WHERE incident_id = ? "
            "AND kind IN ('comm_timeout', 'comm_error') "
            "AND json_extract(fields, '$.remote_rank') IS NOT NULL ORDER BY id",
            (incident_id,),
        ).fetchall()
        return [(remote, rank) for remote, rank in rows]

    def exits_in_open_incidents(
        self, run_id: int | None
    ) -> list[tuple[int, str | None, JSON, str]]:
        """(incident id, node, fields.pid, incident kind) of the run's process failures held
        by an open incident."""
        rows = self._store._conn.execute(
            "SELECT e.incident_id, e.node, json_extract(e.fields, '$.pid'), i.kind "
            "FROM events e JOIN incidents i ON i.id = e.incident_id WHERE e.run_id IS ? "
            "AND e.kind = 'process_failure' AND i.status = 'open'",
            (run_id,),
        ).fetchall()
        return [(int(iid), node, pid, str(kind)) for iid, node, pid, kind in rows]

    def run_has_data_issue(self, run_id: int, *, except_reasons: Sequence[str]) -> bool:
        """A data issue in the run whose reason is none of ``except_reasons``."""
        marks = ", ".join("?" * len(except_reasons))
        row = self._store._conn.execute(
            "SELECT 1 FROM events WHERE run_id IS ? AND kind = 'data_issue' AND "
            f"coalesce(json_extract(fields, '$.reason'), '') NOT IN ({marks}) LIMIT 1",
            (run_id, *except_reasons),
        ).fetchone()
        return row is not None

    def sample_issues(
        self, run_id: int, lo: int, hi: int, reasons: Sequence[str]
    ) -> list[SampleIssue]:
        """The run's unusable samples (``reasons``) in steps ``lo``..``hi``, one per sample."""
        rows = self._store._conn.execute(
            "SELECT min(id), rank, epoch, iter, step, json_extract(fields, '$.reason') AS reason, "
            "json_extract(fields, '$.image'), json_extract(fields, '$.image_id'), min(time) "
            "FROM events WHERE run_id = ? AND kind = 'data_issue' AND step BETWEEN ? AND ? "
            f"AND reason IN ({','.join('?' * len(reasons))}) "
            # the same record read from the log file and from the captured stdout is one sample
            "GROUP BY rank, step, reason, json_extract(fields, '$.image'), "
            "json_extract(fields, '$.image_id')",
            (run_id, lo, hi, *reasons),
        ).fetchall()
        return [SampleIssue(int(r[0]), *r[1:]) for r in rows]

    # -- tensor findings (the NaN origin) --------------------------------------------------------

    def first_tensor_step(self, incident_id: int) -> int | None:
        row = self._store._conn.execute(
            f"SELECT min(step) FROM events WHERE incident_id=? AND step IS NOT NULL AND {_TENSOR}",
            (incident_id,),
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def tensor_findings(self, incident_id: int, step: int) -> list[StoredEvent]:
        return self._select(f"incident_id=? AND step=? AND {_TENSOR}", (incident_id, step))

    def tensor_findings_tagged(
        self, incident_id: int, rank: int | None, tag: str, *, limit: int = 2000
    ) -> list[StoredEvent]:
        """The incident's findings of one tag on one rank, by step."""
        return self._select(
            f"incident_id=? AND rank IS ? AND fields LIKE ? AND {_TENSOR} "
            "ORDER BY step, id LIMIT ?",
            (incident_id, rank, f'%"tag":"{tag}"%', limit),
        )

    def tensor_groups(self, incident_id: int) -> list[TensorGroup]:
        rows = self._store._conn.execute(
            "SELECT step, json_extract(fields, '$.tag') AS tag, rank, count(*), "
            "max(coalesce(json_extract(fields, '$.sampled'), 0)) FROM events "
            f"WHERE incident_id=? AND step IS NOT NULL AND {_TENSOR} "
            "GROUP BY step, tag, rank ORDER BY step, tag, rank",
            (incident_id,),
        ).fetchall()
        return [
            TensorGroup(int(step), tag, rank, int(n), bool(sampled))
            for step, tag, rank, n, sampled in rows
        ]

    def activation_grads_monitored(self, run_id: int | None, incident_id: int) -> bool:
        """Did the run record activation gradients (msprobe's xy_distribution)? Its files say
        so, or one of the incident's findings is one."""
        row = self._store._conn.execute(
            "SELECT 1 FROM sources WHERE run_id = ? AND "
            "(path LIKE '%/actv\\_grad\\_%' ESCAPE '\\' OR path LIKE '%/module\\_step%' "
            "ESCAPE '\\') LIMIT 1",
            (run_id,),
        ).fetchone()
        if row is not None:
            return True
        row = self._store._conn.execute(
            f"SELECT 1 FROM events WHERE incident_id=? AND {_TENSOR} AND fields LIKE "
            '\'%"tag":"actv_grad"%\' LIMIT 1',
            (incident_id,),
        ).fetchone()
        return row is not None

    def empty_tensors(
        self, run_id: int | None, rank: int | None, step: int
    ) -> list[tuple[JSON, JSON, JSON]]:
        """(tensor, module, shape) of the empty tensors msprobe saw on a rank at a step."""
        rows = self._store._conn.execute(
            "SELECT DISTINCT json_extract(fields, '$.tensor'), json_extract(fields, '$.module'), "
            "json_extract(fields, '$.shape') FROM events WHERE kind='data_issue' AND run_id = ? "
            'AND rank IS ? AND step=? AND fields LIKE \'%"reason":"empty tensor"%\' LIMIT 5',
            (run_id, rank, step),
        ).fetchall()
        return [(t, m, s) for t, m, s in rows]

    def first_text_event(self, incident_id: int) -> StoredEvent | None:
        """The incident's first event that is not a tensor finding (a training log line)."""
        found = self._select(
            f"incident_id=? AND NOT ({_TENSOR}) ORDER BY step IS NULL, step, id LIMIT 1",
            (incident_id,),
        )
        return found[0] if found else None

    # -- writes ----------------------------------------------------------------------------------

    def assign(self, incident_id: int, event_ids: Iterable[int]) -> None:
        """Attach events to an incident."""
        self._store._conn.executemany(
            "UPDATE events SET incident_id=? WHERE id=?", [(incident_id, i) for i in event_ids]
        )

    def move(self, src: int, dst: int) -> None:
        """Every event of incident ``src`` now belongs to ``dst``."""
        self._store.execute("UPDATE events SET incident_id = ? WHERE incident_id = ?", (dst, src))


class MetricReads:
    """What correlation asks of the logged iterations (stored as blocks: ``store.metrics``)."""

    def __init__(self, store: Store) -> None:
        from .metrics import Metrics

        self._store = store
        self._metrics = Metrics(store)

    def newest_id(self) -> int:
        """The newest metric block (0: none); block ids only grow."""
        return self._metrics.last_block()

    def finite_losses_after(self, run_id: int | None, step: int) -> int:
        """How many training iterations after ``step`` logged a finite loss."""
        return self._metrics.trained_after(run_id, step)

    def last_finite_step_before(self, run_id: int, step: int) -> int | None:
        return self._metrics.trained_before(run_id, step)

    def trained_later(
        self, experiment: str, run_id: int
    ) -> list[tuple[str, int | None, int | None]]:
        """(name, highest step, highest epoch) that each later run of the experiment trained
        to (a step counts when its loss is finite), oldest run first."""
        rows = self._store._conn.execute(
            "SELECT id, name FROM runs WHERE experiment = ? AND id > ? ORDER BY id",
            (experiment, run_id),
        ).fetchall()
        out = []
        for later_id, name in rows:
            max_step, max_epoch = self._metrics.trained_to(int(later_id))
            if max_step is not None or max_epoch is not None:
                out.append((str(name), max_step, max_epoch))
        return out
