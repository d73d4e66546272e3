"""Which run each file's events belong to, and who they are: run assignment, launches, ranks.

A file is given its run (``sources/runs.py`` names it, the store numbers it) when its first
bytes are read; what the run's launcher printed (torchrun's layout, the scheduler's job) is kept
per run and completes the ranks of every event committed for it; after a pass, the runs that
learned something have their cluster identity (job, run, node) derived again
(``sources/identity.py``) and stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ..config import ClusterConfig
from ..detect.companion import run_update
from ..events import Event
from ..sources import Root
from ..sources.identity import identity_of_run, rank_fill, stored_names, this_node
from ..sources.runs import run_key
from ..store import Store
from ..store.records import JSON
from ..store.sources import SourceRuns
from ..stream import StreamState


class RunIdentity:
    """Run ids for files, the launch each run printed, the cluster names of each run.

    ``forced_run`` (``--run NAME`` or ``[cluster] run``) puts every file in one run."""

    def __init__(self, store: Store, cluster: ClusterConfig, *, forced_run: str | None) -> None:
        self.store = store
        self.runs = SourceRuns(store)
        self.cluster = cluster
        self.forced_run = forced_run
        self._ids: dict[tuple[str, str], int] = {}
        # runs whose cluster identity (job, run, node) must be derived again after this pass
        self._dirty: set[int] = set()
        self._launch: dict[int, dict[str, str]] = {}  # what each run's logs printed (launch)

    def reconfigure(self, cluster: ClusterConfig, *, forced_run: str | None) -> None:
        self.cluster = cluster
        self.forced_run = forced_run

    # -- assignment ------------------------------------------------------------------------------

    def assign(self, root: Root, path: str) -> int:
        """The run of a file under ``root`` (created on first use)."""
        if self.forced_run:
            key = ("<run>", self.forced_run)
            if key not in self._ids:
                self._ids[key] = self.store.run_id(
                    "<run>", self.forced_run, self.forced_run, node=this_node(self.cluster.node)
                )
                self._dirty.add(self._ids[key])
            return self._ids[key]
        rk = run_key(root, path)
        k = (rk.root, rk.launch)
        if k not in self._ids:
            self._ids[k] = self.store.run_id(
                rk.root,
                rk.launch,
                rk.name,
                experiment=rk.experiment,
                node=this_node(self.cluster.node),
            )
            self._dirty.add(self._ids[k])
        return self._ids[k]

    def touched(self, run_ids: Iterable[int]) -> None:
        """These runs learned something (events, facts, a new config): derive them again."""
        self._dirty.update(run_ids)

    # -- what the logs told ----------------------------------------------------------------------

    def launch_printed(self, run_id: int, launch: Mapping[str, str]) -> None:
        """A stream printed its launch (in the caller's transaction)."""
        self.store.update_run_facts(run_id, {"launch": dict(launch)})
        self._launch.pop(run_id, None)

    def record_facts(self, run_id: int, facts: list[dict[str, JSON]]) -> None:
        """Facts a run's lines told (companion records, environment reports), with its events."""
        run = self.runs.get(run_id)
        self.store.update_run_facts(run_id, run_update(run.facts if run else {}, facts))

    def identify(self, run_id: int | None, events: list[Event], state: StreamState) -> list[Event]:
        """Node, global and local rank on every event: this node unless the line named one;
        ranks completed from each other with what the launcher printed (sources/identity.py)."""
        if not events:
            return events
        launch = dict(self._run_launch(run_id))
        launch.update(state.launch or {})
        node = this_node(self.cluster.node)
        out = []
        for e in events:
            rank, local = rank_fill(e.rank, e.local_rank, launch)
            if e.node is None or rank != e.rank or local != e.local_rank:
                e = dataclasses.replace(e, node=e.node or node, rank=rank, local_rank=local)
            out.append(e)
        return out

    def _run_launch(self, run_id: int | None) -> dict[str, str]:
        if run_id is None:
            return {}
        hit = self._launch.get(run_id)
        if hit is None:
            run = self.runs.get(run_id)
            printed = run.facts.get("launch") if run is not None else None
            hit = dict(printed) if isinstance(printed, dict) else {}
            self._launch[run_id] = hit
        return hit

    # -- cluster identity ------------------------------------------------------------------------

    def refresh(self) -> list[int]:
        """Store the derived identity of the runs touched since the last call (``runs.job``,
        ``cluster_run``, ``node``), in one transaction; returns the ids whose identity changed."""
        if not self._dirty:
            return []
        changed: list[int] = []
        with self.store.transaction():
            for rid in sorted(self._dirty):
                run = self.runs.get(rid)
                if run is None:
                    continue
                ident = identity_of_run(
                    name=run.name,
                    experiment=run.experiment,
                    launch=run.launch,
                    facts=run.facts,
                    cluster=self.cluster,
                    forced_run=self.forced_run,
                )
                job, crun = stored_names(ident)
                if (job, crun, ident.node) != (run.job, run.cluster_run, run.node):
                    self.runs.set_identity(rid, job=job, cluster_run=crun, node=ident.node)
                    changed.append(rid)
        self._dirty.clear()
        return changed
