"""Events -> incidents with one root cause.

The correlator reads the events committed since its last pass and attaches each to an incident
of its run. Events are grouped by a fingerprint (the kind, plus the normalised message for
open-ended kinds; a run's communication timeouts and errors by backend); a root cause absorbs
its symptoms (see ``chains.py``): collective timeouts on the other ranks, the launcher's report
that the rank died; an exit a rank's own communication failure caused follows that failure
(``effects.py``). Every material change bumps the incident's ``version`` and is returned as a
:class:`Change` for the outbox.

The store is reached only through ``store.events`` and ``store.incidents``: events come in as
``StoredEvent`` and incidents as ``Incident`` records; what a pass decides goes back as
``NewIncident``, ``IncidentUpdate`` (everything one pass learned, the origin function's
explanation included) or ``StatusChange``, which the store writes.

Lifecycle: ``open`` -> ``resolved`` when the run recovers (finite losses again after a NaN) or,
under ``watch``, after a quiet period; a recurrence later opens a new incident. Incidents
absorbed into another one become ``merged``. ``scan`` never resolves an incident because its
input ended.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import field, replace
from typing import TYPE_CHECKING

from .._dc import dataclass
from ..events import format_utc, now_utc
from ..store.db import Store
from ..store.events import Events, MetricReads
from ..store.incidents import Incidents, IncidentUpdate, NewIncident, StatusChange
from ..store.metrics import Metrics
from ..store.records import JSON, Incident, StoredEvent
from . import effects, samples, slowdown
from .chains import (
    ROOT_KINDS,
    SYMPTOM_KINDS,
    Root,
    Timeouts,
    absorbs,
    links,
    may_be_torn_down,
    roots_of_run,
    torn_down,
)
from .origin import origin_for, origin_of
from .story import describe

if TYPE_CHECKING:
    from .knowledge import Knowledge

_NUM = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
_PATH = re.compile(r"(?:/[\w.\-]+)+")
_WS = re.compile(r"\s+")

# Kinds whose events of one run are always one incident, whatever their text.
_ONE_PER_RUN = {"nan", "oom", "process_failure", "slowdown", "data_issue", "overflow"}
RECOVERY_ITERATIONS = 20  # finite logged losses after the last NaN that mean "recovered"


def fingerprint(kind: str, message: str, fields: Mapping[str, JSON]) -> str:
    """Group key within a run: the kind, plus the normalised message for open-ended kinds."""
    if kind in _ONE_PER_RUN:
        return kind
    if kind in ("comm_timeout", "comm_error"):
        # a run's timeouts and errors on one backend are one failure seen from several ranks
        # (one rank's communicator aborted, another's watchdog timed out)
        backend = str(fields.get("backend") or "")
        return f"comm:{backend}"
    text = _PATH.sub("<path>", message)
    text = _NUM.sub("<n>", text)
    text = _WS.sub(" ", text).strip().lower()[:160]
    return f"{kind}:{text}"


@dataclass
class Change:
    """A material change of an incident, for the outbox."""

    incident_id: int
    action: str  # open | update | resolve
    version: int
    news: list[str] = field(default_factory=list)  # what changed, for follow-ups


@dataclass
class _Acc:
    """What one pass learned about one incident."""

    incident: Incident
    new_events: list[StoredEvent] = field(default_factory=list)
    created: bool = False
    news: list[str] = field(default_factory=list)
    recount: bool = False


class Correlator:
    """Incremental: each pass handles the events committed since the previous one."""

    META_KEY = "correlated_upto"

    def __init__(
        self,
        store: Store,
        *,
        timeouts: Timeouts | None = None,
        knowledge: Knowledge | Callable[[], Knowledge] | None = None,
        resolve_after: float | None = None,
    ) -> None:
        """``knowledge`` may be a function that loads it: called when a first incident needs
        its hints (a scan that finds nothing never reads the knowledge base)."""
        self.store = store
        self.events = Events(store)
        self.incidents = Incidents(store)
        self.metrics = MetricReads(store)
        self.timeouts = timeouts or Timeouts()
        self._knowledge = knowledge
        self.resolve_after = resolve_after
        self._pending_changes: list[Change] = []
        # the (metrics, incidents) ids relaunches were last looked at
        self._relaunch_upto: tuple[int | None, int | None] | None = None

    @property
    def knowledge(self) -> Knowledge | None:
        if callable(self._knowledge):
            self._knowledge = self._knowledge()
        return self._knowledge

    def process(
        self, *, live: bool = False, now: float | None = None, slowdowns: bool = True
    ) -> list[Change]:
        """Correlate new events; under ``watch`` (``live``) also resolve quiet incidents.

        ``slowdowns=False`` leaves the step times committed since the last look for a later
        pass (a slowdown is a trend: rereading a long run's step times on every pass of a busy
        daemon would cost more than everything else it does)."""
        if slowdowns:
            self._slowdowns()
        last = int(self.store.meta_get(self.META_KEY, "0") or 0)
        changes: list[Change] = []
        while True:
            batch = self.events.after(last, limit=20000)
            if not batch:
                break
            with self.store.transaction():
                changes.extend(self._apply(batch))
                last = batch[-1].id
                self.store.meta_set(self.META_KEY, str(last))
        with self.store.transaction():
            changes.extend(self._recoveries())
            changes.extend(self._relaunched())
            if live and self.resolve_after:
                changes.extend(self._resolve_quiet(time.time() if now is None else now))
        return changes

    # -- derived events --------------------------------------------------------------------------

    def _slowdowns(self) -> None:
        """Slowdown events for runs with new step times (and the runs compared with them)."""
        with self.store.transaction():
            for run_id, finding in slowdown.Tracker(Metrics(self.store)).update():
                if self.events.run_has_kind(run_id, "slowdown"):
                    continue  # one finding per run; its incident tracks what follows
                self.store.insert_events(
                    run_id, finding.at.source_id, [slowdown.to_event(finding)], now_utc()
                )

    # -- one batch -------------------------------------------------------------------------------

    def _apply(self, events: Iterable[StoredEvent]) -> list[Change]:
        accs: dict[int, _Acc] = {}
        self._pending_changes = []

        # roots first, so their symptoms in the same batch find them
        def rank_of_kind(e: StoredEvent) -> tuple[int, int]:
            k = e.kind
            if may_be_torn_down(e):
                return (3, e.id)  # after the communication failures it may follow from
            return (0 if k in ROOT_KINDS else 2 if k in SYMPTOM_KINDS else 1, e.id)

        touched_runs: set[int | None] = set()
        data_runs: set[int | None] = set()
        for ev in sorted(events, key=rank_of_kind):
            if ev.fields.get("incident") is False:
                if ev.kind == "data_issue":
                    data_runs.add(ev.run_id)
                continue  # kept as an event, not incident-worthy on its own (e.g. early overflow)
            inc = None
            if may_be_torn_down(ev):
                inc = self._comm_incident_for(ev, accs)
            if inc is None and (ev.kind in SYMPTOM_KINDS or ev.kind == "process_failure"):
                inc = self._root_for(ev, accs)
            if inc is None:
                key = fingerprint(ev.kind, ev.message, ev.fields)
                inc = self._open_incident(ev.run_id, key, accs)
                if inc is None and ev.kind in ("comm_timeout", "comm_error"):
                    inc = self._comm_sibling(ev.run_id, key, accs)
                if inc is None:
                    inc = self._create(ev, key)
                    accs[inc.id] = _Acc(inc, created=True)
            acc = accs.setdefault(inc.id, _Acc(inc))
            acc.new_events.append(ev)
            if ev.kind in ROOT_KINDS or ev.kind in SYMPTOM_KINDS:
                touched_runs.add(ev.run_id)
        for run_id in data_runs:
            # samples reported after the NaN's incident opened (another rank's file read later)
            inc = self._open_incident(run_id, "nan", accs)
            if inc is not None:
                accs.setdefault(inc.id, _Acc(inc))
        for acc in list(accs.values()):
            self._attach(acc)
        for run_id in touched_runs:
            self._absorb_orphans(run_id, accs)
        changes = list(self._pending_changes)
        for acc in accs.values():
            ch = self._update(acc)
            if ch is not None:
                changes.append(ch)
        return changes

    def _root_for(self, ev: StoredEvent, accs: Mapping[int, _Acc]) -> Incident | None:
        """The open root-cause incident this symptom follows from, if any."""
        timeouts = self._timeouts(ev.run_id)
        for root in roots_of_run(self.incidents, ev.run_id):
            if root.kind == ev.kind or effects.torn_down_by(self.events, root, ev):
                continue  # the root's exit is this failure's effect, not its cause
            if ev.kind == "process_failure":
                if root.kind != "oom" or not absorbs(root, _as_root(ev)):
                    continue
            elif not links(root, ev, timeouts, self._root_event(root)):
                continue
            acc = accs.get(root.incident_id)
            return acc.incident if acc else self.incidents.get(root.incident_id)
        return None

    def _root_event(self, root: Root) -> StoredEvent | None:
        return self.events.get(root.event_id) if root.event_id is not None else None

    def _comm_incident_for(self, ev: StoredEvent, accs: Mapping[int, _Acc]) -> Incident | None:
        """A worker that exited with an exception or an abort shortly after a communication
        failure on its own rank (an NCCL/HCCL error raised in it, a watchdog taking the process
        down, then torchrun's report) failed because of that failure: its exit joins the
        failure's incident, whatever that incident's root is."""
        for acc in accs.values():
            for other in acc.new_events:
                if other.run_id == ev.run_id and torn_down(ev, other):
                    return acc.incident
        for other in effects.comm_events_of(self.events, ev):
            if torn_down(ev, other) and other.incident_id is not None:
                held = accs.get(other.incident_id)
                inc = held.incident if held else self.incidents.get(other.incident_id)
                if inc is not None and inc.status == "open":
                    return inc
        return None

    def _absorb_orphans(self, run_id: int | None, accs: dict[int, _Acc]) -> None:
        """A root that arrived after its symptoms takes them over; a process failure whose
        cause arrived after it (its own rank's watchdog timeout) joins that cause."""
        while (pair := effects.next_effect(self.events, self.incidents, run_id)) is not None:
            self._merge(*pair, accs)
        roots = roots_of_run(self.incidents, run_id)
        if not roots:
            return
        timeouts = self._timeouts(run_id)
        own = {r.incident_id: self._root_event(r) for r in roots}  # read once, not per orphan
        kinds = ("comm_timeout", "comm_error", "process_failure")
        for orphan in self.incidents.open_of_kinds(run_id, kinds):
            iid, kind = orphan.id, orphan.kind
            evs = self.events.of_incident(iid, limit=200)
            if not evs:
                continue
            for root in roots:
                if root.incident_id == iid:
                    continue
                if kind == "process_failure":
                    ok = root.kind == "oom" and absorbs(root, _as_root(evs[0]))
                else:
                    # the incident's communication failures say whether it followed from the
                    # root; an exit that joined them as their effect (the launcher's traceback
                    # after a watchdog) says nothing of when they happened
                    comm = [e for e in evs if e.kind in SYMPTOM_KINDS] or evs
                    ok = any(links(root, e, timeouts, own[root.incident_id]) for e in comm)
                if ok:
                    self._merge(iid, root.incident_id, accs)
                    break

    def _merge(self, src: int, dst: int, accs: dict[int, _Acc]) -> None:
        self.events.move(src, dst)
        src_acc = accs.pop(src, None)
        was_new = src_acc is not None and src_acc.created
        if was_new:
            self.incidents.delete(src)
        else:
            held = self.incidents.get(src)
            version = (held.version if held else 0) + 1
            detail = {**(held.detail if held else {}), "merged_into": dst}
            self.incidents.close(StatusChange(src, "merged", version, detail))
            self._pending_changes.append(
                Change(src, "update", version, [f"merged into incident #{dst}"])
            )
        acc = accs.get(dst)
        if acc is None:
            inc = self.incidents.get(dst)
            if inc is None:
                return
            acc = accs[dst] = _Acc(inc)
        acc.recount = True

    def _open_incident(
        self, run_id: int | None, key: str, accs: Mapping[int, _Acc]
    ) -> Incident | None:
        for acc in accs.values():
            inc = acc.incident
            if inc.run_id == run_id and inc.key == key and inc.status == "open":
                return inc
        return self.incidents.open_by_key(run_id, key)

    def _comm_sibling(
        self, run_id: int | None, key: str, accs: Mapping[int, _Acc]
    ) -> Incident | None:
        """Communication incidents are one per backend, but not every line names its backend
        (one rank's heartbeat report says NCCL, another's does not): an event whose backend is
        unknown joins its run's one open communication incident, and one that names its
        backend joins an open one whose backend was unknown."""
        if not key.endswith(":"):
            return self._open_incident(run_id, "comm:", accs)
        ids = self.incidents.open_comm_ids(run_id)
        if len(ids) != 1:
            return None
        acc = accs.get(ids[0])
        return acc.incident if acc else self.incidents.get(ids[0])

    def _create(self, ev: StoredEvent, key: str) -> Incident:
        new = NewIncident(
            run_id=ev.run_id,
            kind=ev.kind,
            key=key,
            title=ev.message[:200],
            time=ev.time,
            origin=origin_of(ev),
            root_event_id=ev.id,
        )
        # no origin yet, so that the first update reports the origin as news-free
        return replace(self.incidents.create(new), origin={})

    def _attach(self, acc: _Acc) -> None:
        self.events.assign(acc.incident.id, (e.id for e in acc.new_events))

    def _update(self, acc: _Acc) -> Change | None:
        inc = acc.incident
        iid = inc.id
        if acc.recount:
            span = self.events.span(iid)
            count, first, last = span.count, span.first_time, span.last_time
            ranks, nodes = set(span.ranks), set(span.nodes)
        else:
            ranks = set(inc.ranks)
            ranks.update(e.rank for e in acc.new_events if e.rank is not None)
            nodes = set(inc.detail.get("nodes") or [])
            nodes.update(e.node for e in acc.new_events if e.node)
            times: list[JSON] = [t for t in (inc.first_time, inc.last_time) if t]
            times += [
                e.time or e.fields.get("stream_time")
                for e in acc.new_events
                if e.time or e.fields.get("stream_time")
            ]
            first, last = (min(times), max(times)) if times else (None, None)
            count = inc.event_count + len(acc.new_events)
        found = origin_for(inc.kind)(self.events, inc)
        origin = found.block
        run = self.incidents.run(inc.run_id)
        story = describe(self.events, iid, inc.kind, origin, run)
        # what the origin's finding explains (the NaN story), then the incident's own story
        detail: dict[str, JSON] = {**inc.detail, **found.explains, **story.detail}
        detail["nodes"] = sorted(nodes)  # where its events were read (several when merged)
        if inc.kind == "nan":
            related = samples.related(self.events, self.metrics, inc.run_id, origin)
            if related:
                detail["related_data_issues"] = related
        hints = (
            self.knowledge.hints_for(self.events, iid, inc.kind, origin, detail, run)
            if self.knowledge is not None
            else list(inc.hints)
        )
        news = list(acc.news)
        added = sorted(ranks - set(inc.ranks))
        if added and not acc.created:
            news.append("ranks " + ",".join(str(r) for r in added) + " affected")
        if inc.origin and _where(origin) != _where(inc.origin):
            news.append("origin moved to " + _where(origin))
        if (
            detail.get("root_cause")
            and detail.get("root_cause") != inc.detail.get("root_cause")
            and not acc.created
        ):
            news.append("root cause: " + str(detail["root_cause"]))
        material = acc.created or bool(news) or story.title != inc.title
        version = inc.version + 1 if material else inc.version
        self.incidents.update(
            IncidentUpdate(
                id=iid,
                ranks=tuple(sorted(ranks)),
                first_time=first,
                last_time=last,
                event_count=count,
                origin=origin,
                title=story.title,
                root_event_id=found.event.id if found.event else inc.root_event_id,
                detail=detail,
                hints=tuple(hints),
                version=version,
            )
        )
        if not material:
            return None
        return Change(iid, "open" if acc.created else "update", version, news)

    def _timeouts(self, run_id: int | None) -> Timeouts:
        """The config's collective timeouts, else those the run's facts say were in force."""
        run = self.incidents.run(run_id)
        return self.timeouts.with_facts(run.facts if run is not None else {})

    # -- lifecycle -------------------------------------------------------------------------------

    def _recoveries(self) -> list[Change]:
        """NaN incidents whose run logs finite losses again for a while are resolved."""
        out: list[Change] = []
        for inc, last_step in self.incidents.open_nan_last_steps():
            if last_step is None:
                continue
            n = self.metrics.finite_losses_after(inc.run_id, last_step)
            if n >= RECOVERY_ITERATIONS:
                detail = dict(inc.detail)
                detail["resolution"] = (
                    f"the loss was finite for {n} logged iterations after step {last_step}"
                )
                out.append(self._resolve(inc.id, inc.version, detail))
        return out

    def _relaunched(self) -> list[Change]:
        """Open incidents that a later run of the same experiment trained past: its training
        reached a step beyond the incident's origin step (or an epoch beyond its epoch)."""
        out: list[Change] = []
        # only new step counts (or new incidents) can change the answer: look again then
        newest = (self.metrics.newest_id(), self.incidents.newest_id())
        if newest == self._relaunch_upto:
            return out
        self._relaunch_upto = newest
        for inc, experiment in self.incidents.open_in_experiments():
            step, epoch = inc.origin.get("step"), inc.origin.get("epoch")
            if (step is None and epoch is None) or inc.run_id is None:
                continue
            for name, max_step, max_epoch in self.metrics.trained_later(experiment, inc.run_id):
                if step is not None and max_step is not None and max_step > step:
                    past = f"step {max_step}, past the incident's step {step}"
                elif (
                    step is None
                    and epoch is not None
                    and max_epoch is not None
                    and max_epoch > epoch
                ):
                    past = f"epoch {max_epoch}, past the incident's epoch {epoch}"
                else:
                    continue
                detail = dict(inc.detail)
                detail["resolution"] = (
                    f"{name}, a relaunch of the same experiment, trained to {past}"
                )
                detail["resolved_by_run"] = name
                out.append(self._resolve(inc.id, inc.version, detail))
                break
        return out

    def _resolve_quiet(self, now: float) -> list[Change]:
        assert self.resolve_after is not None
        cutoff = format_utc(now - self.resolve_after)
        out = []
        for inc in self.incidents.open_updated_before(cutoff):
            detail = dict(inc.detail)
            detail["resolution"] = (
                f"no new events for {int(self.resolve_after)} s while nanwatch was watching"
            )
            out.append(self._resolve(inc.id, inc.version, detail))
        return out

    def _resolve(self, iid: int, version: int, detail: Mapping[str, JSON]) -> Change:
        self.incidents.close(StatusChange(iid, "resolved", version + 1, detail))
        return Change(iid, "resolve", version + 1, [str(detail.get("resolution", "resolved"))])


def _as_root(ev: StoredEvent) -> Root:
    from .chains import event_time

    ranks = {ev.rank} if ev.rank is not None else set()
    for r in ev.fields.get("failed_ranks") or ():
        if isinstance(r, int):
            ranks.add(r)
    return Root(ev.id, ev.kind, ev.rank, frozenset(ranks), event_time(ev))


def _where(origin: Mapping[str, JSON]) -> str:
    parts = [f"{k} {origin[k]}" for k in ("rank", "step", "tensor") if origin.get(k) is not None]
    return ", ".join(parts)
