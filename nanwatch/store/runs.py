"""Runs as the read side sees them: by name, listed with their status and span, their facts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .db import Store
from .records import JSON, Run, RunSummary, columns, loads
from .records import RUN_COLUMNS as RUN_ROW

RUN_COLUMNS = columns(RUN_ROW, "r")


# what each run's rows count; its span from its events and metrics for databases written
# before runs kept their own (first_time/last_time NULL)
_SUMMARY = (
    f"SELECT {RUN_COLUMNS}, "
    "(SELECT count(*) FROM sources s WHERE s.run_id = r.id), "
    "(SELECT count(*) FROM events e WHERE e.run_id = r.id), "
    "(SELECT count(*) FROM incidents i WHERE i.run_id = r.id), "
    "(SELECT count(*) FROM incidents i WHERE i.run_id = r.id AND i.status = 'open'), "
    "(SELECT group_concat(DISTINCT nullif(s.node, '')) FROM sources s WHERE s.run_id = r.id), "
    "min((SELECT min(time) FROM events e WHERE e.run_id = r.id), "
    "coalesce((SELECT min(time_min) FROM metric_blocks m WHERE m.run_id = r.id), '9')), "
    "max((SELECT max(time) FROM events e WHERE e.run_id = r.id), "
    "coalesce((SELECT max(time_max) FROM metric_blocks m WHERE m.run_id = r.id), '')) "
    "FROM runs r ORDER BY r.id"
)


class Runs:
    """The ``runs`` table, read side."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def names(self) -> list[str]:
        """Every run's name, oldest first."""
        return [str(n) for (n,) in self.store.execute("SELECT name FROM runs ORDER BY id")]

    def names_of(self, ids: Sequence[int]) -> list[str]:
        """The names of the runs ``ids``, oldest first (unknown ids are left out)."""
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        sql = f"SELECT name FROM runs WHERE id IN ({marks}) ORDER BY id"
        return [str(n) for (n,) in self.store.execute(sql, list(ids))]

    def by_name(self, name: str) -> Run | None:
        row = self.store.execute(
            f"SELECT {RUN_COLUMNS} FROM runs r WHERE r.name = ?", (name,)
        ).fetchone()
        return Run.from_row(row) if row else None

    def facts(self, run_id: int) -> Mapping[str, JSON]:
        """What the run's logs said about it (versions, world size, launch ...); {} if none."""
        row = self.store.execute("SELECT facts FROM runs WHERE id = ?", (run_id,)).fetchone()
        facts: Mapping[str, JSON] = loads(row[0], {}) if row else {}
        return facts

    def summaries(self) -> list[RunSummary]:
        """Every run, oldest first, with its counts, status and span."""
        out = []
        for row in self.store.execute(_SUMMARY):
            run = Run.from_row(row[:12])
            nsrc, nev, ninc, nopen, nodes, first_rows, last_rows = row[12:]
            out.append(
                RunSummary(
                    run=run,
                    sources=int(nsrc),
                    events=int(nev),
                    incidents=int(ninc),
                    open_incidents=int(nopen),
                    nodes=(
                        tuple(sorted(str(nodes).split(",")))
                        if nodes
                        else ((run.node,) if run.node else ())
                    ),
                    first_time=run.first_time or first_rows,
                    last_time=run.last_time or last_rows,
                )
            )
        return out
