"""Incidents that are effects of another one: exits a communication failure caused.

The correlator asks, after each batch, which open process-failure incident of a run is really
another incident's effect (see ``chains.py`` for the evidence): its root exit is one that a
watchdog's timeout on the same rank caused, read before that timeout; or every exit in it is
one the launcher reported again, by global rank, in another incident (torchrun prints
``failed (exitcode: 1) local_rank: 2 (pid: 31106)`` and then, in its summary, ``rank : 6
(local_rank: 2)``; the first names only the local rank).
"""

from __future__ import annotations

from ..store.events import Events
from ..store.incidents import Incidents
from ..store.records import JSON, StoredEvent
from .chains import Root, may_be_torn_down, roots_of_run, torn_down


def comm_events_of(events: Events, ev: StoredEvent) -> list[StoredEvent]:
    """The run's correlated communication failures that could be ``ev``'s process's."""
    rank = ev.rank if ev.rank is not None else ev.local_rank
    return events.comm_failures(ev.run_id, rank)


def root_exit(events: Events, root: Root) -> StoredEvent | None:
    """The root event of a process-failure root, if it is an exit a failure could cause."""
    if root.kind != "process_failure" or root.event_id is None:
        return None
    ev = events.get(root.event_id)
    return ev if ev is not None and may_be_torn_down(ev) else None


def torn_down_by(events: Events, root: Root, ev: StoredEvent) -> bool:
    """Is ``root`` (a process failure) the exit that communication failure ``ev`` caused?"""
    exit_ev = root_exit(events, root)
    return exit_ev is not None and torn_down(exit_ev, ev)


def _open(incidents: Incidents, incident_id: int | None) -> bool:
    inc = incidents.get(incident_id) if incident_id is not None else None
    return inc is not None and inc.status == "open"


def next_effect(events: Events, incidents: Incidents, run_id: int | None) -> tuple[int, int] | None:
    """(an open incident of the run, the open incident it is an effect of), or None."""
    for root in roots_of_run(incidents, run_id):
        exit_ev = root_exit(events, root)
        if exit_ev is None:
            continue
        for other in comm_events_of(events, exit_ev):
            dst = other.incident_id
            if dst != root.incident_id and torn_down(exit_ev, other) and _open(incidents, dst):
                assert dst is not None
                return root.incident_id, dst
    return _repeated_report(events, run_id)


def _repeated_report(events: Events, run_id: int | None) -> tuple[int, int] | None:
    """A process-failure incident whose every exit (node, pid) is in another open incident."""
    rows = events.exits_in_open_incidents(run_id)
    where: dict[tuple[str | None, JSON], set[int]] = {}
    for iid, node, pid, _kind in rows:
        if pid is not None:
            where.setdefault((node, pid), set()).add(iid)
    for iid in sorted({r[0] for r in rows if r[3] == "process_failure"}):
        mine = [(n, p) for i, n, p, _k in rows if i == iid]
        if events.kinds(iid) != ["process_failure"] or any(p is None for _n, p in mine):
            continue
        others = set.intersection(*(where[k] - {iid} for k in mine)) if mine else set()
        if others:
            return iid, min(others)
    return None
