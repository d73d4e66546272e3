"""Where an incident started: its origin block (ARCHITECTURE.md vocabulary).

``origin_for(kind)`` returns the function that computes an incident's origin from its events.
Kinds register their own (NaN localisation across ranks and tensor families has one); the
default takes the earliest event by (step, time, rank).

A caused incident (an OOM or a process failure that other ranks' timeouts follow from) takes its
origin from its root event: the event of the incident's own kind that happened first, never from
one of its symptoms, whatever their steps and times say. The root moves only on evidence (another
event of the root's kind known to be earlier); an equal or unknown time keeps the one chosen.

``origin.evidence`` (added when there is any) says why the origin's rank is the root:
``named_by``, the ranks whose communication failures named it as the peer they waited for
(HCCL ``remote rank [3]``, gloo's monitoredBarrier); for a process failure, the launcher's
``report`` with its ``exit_code`` and ``signal``. A communication incident without a root of its
own (the rank that failed left no line: SIGKILL from the host's OOM killer, a lost node) whose
failures name a rank that printed nothing in it takes that rank as its origin: ``origin.rank`` is
the silent rank, ``evidence.silent`` is true and ``evidence.first_seen_rank`` the rank whose
failure came first. The incident stays a communication incident: nothing says how that rank
ended, only that it stopped responding.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import field

from .._dc import dataclass
from ..store.events import Events
from ..store.records import JSON, Incident, StoredEvent
from .chains import SYMPTOM_KINDS, event_time


@dataclass(frozen=True)
class Origin:
    """What an origin function decided: the root event, the origin block, and what its finding
    explains (keys of the incident's ``detail``, such as the NaN story's ``root_cause``); the
    correlator puts them into the incident's update, which the store writes."""

    event: StoredEvent | None
    block: dict[str, JSON]
    explains: Mapping[str, JSON] = field(default_factory=dict)


OriginFn = Callable[[Events, Incident], Origin]
"""(the events, the incident) -> its origin."""

_REGISTRY: dict[str, OriginFn] = {}
# kinds whose origin function lives in a module of its own, imported when an incident of that
# kind is first looked at (NaN localisation pulls in the msprobe name tables)
_PROVIDERS = {"nan": ".nan"}


def register(kind: str) -> Callable[[OriginFn], OriginFn]:
    def deco(fn: OriginFn) -> OriginFn:
        _REGISTRY[kind] = fn
        return fn

    return deco


def origin_for(kind: str) -> OriginFn:
    provider = _PROVIDERS.get(kind)
    if provider is not None and kind not in _REGISTRY:
        importlib.import_module(provider, __package__)  # registers its function
    return _REGISTRY.get(kind, earliest_event_origin)


def sort_key(ev: StoredEvent) -> tuple[int, int, str, int, int]:
    """Earliest first: known steps before unknown, then time, then rank, then arrival."""
    step = ev.step
    return (
        0 if step is not None else 1,
        step if step is not None else 0,
        ev.time or ev.fields.get("stream_time") or "~",
        ev.rank if ev.rank is not None else 1 << 30,
        ev.id,
    )


_RootKey = tuple[bool, bool, float, bool, bool, int, bool]


def _root_key(ev: StoredEvent, named: Mapping[int, set[int]]) -> _RootKey:
    """Which of two events of the root's kind came first: an exit the launcher caused (SIGTERM)
    after any other; a known time before an unknown one, then the time (a traceback's is the
    last time its stream printed); at the same time, one on a rank the symptoms name as the
    peer they waited for (a launcher may report one exit by local rank and again by global
    rank), then the step; an event that says where it happened before one that does not."""
    t = event_time(ev)
    step = ev.step
    located = ev.rank is not None or ev.local_rank is not None
    # a launcher stops the survivors with SIGTERM after it saw the first failure; its summary
    # lists them before that failure, all under one time
    stopped = ev.fields.get("signal") == "SIGTERM"
    return (
        stopped,
        t is None,
        t or 0.0,
        ev.rank not in named,
        step is None,
        step or 0,
        not located,
    )


def root_event(events: Events, inc: Incident) -> StoredEvent | None:
    """The incident's root: its first event of the incident's own kind. The one chosen before
    stays unless another is known to be earlier (ties and missing times keep it)."""
    evs = events.of_incident(inc.id, kind=inc.kind)
    if not evs:
        return events.earliest(inc.id)
    named = _named(events, inc.id)

    def key(e: StoredEvent) -> _RootKey:
        return _root_key(e, named)

    best = min(evs, key=key)  # min keeps the first arrived of equals
    held = next((e for e in evs if e.id == inc.root_event_id), None)
    if held is not None and not key(best) < key(held):
        return held
    return best


def origin_of(ev: StoredEvent) -> dict[str, JSON]:
    """The origin block of an incident rooted at one event."""
    f = ev.fields
    extra = {k: f[k] for k in ("ratio", "baseline", "current", "against") if k in f}
    tensor = f.get("tensor")
    if "loss" in (f.get("tensors") or ()):
        tensor = "loss"  # a line with several non-finite terms: the total loss says it best
    return {
        **extra,
        "rank": ev.rank,
        "step": ev.step,
        "epoch": ev.epoch,
        "iter": ev.iter,
        "stage": ev.stage,
        "phase": f.get("phase"),
        "tag": f.get("tag"),
        "tensor": tensor,
        "shape": f.get("shape"),
        "dtype": f.get("dtype"),
        "module": f.get("module"),
        "first_param": f.get("first_param"),
        "time": ev.time or f.get("stream_time"),
        "event_id": ev.id,
    }


def earliest_event_origin(events: Events, inc: Incident) -> Origin:
    ev = events.earliest(inc.id)
    return Origin(ev, origin_of(ev) if ev else {})


def root_event_origin(events: Events, inc: Incident) -> Origin:
    ev = root_event(events, inc)
    if ev is None:
        return Origin(None, {})
    origin = origin_of(ev)
    evidence: dict[str, JSON] = {}
    if origin["rank"] is not None:
        namers = _named(events, inc.id).get(origin["rank"])
        if namers:
            evidence["named_by"] = sorted(namers)
    if ev.kind == "process_failure":
        f = ev.fields
        evidence["report"] = ev.message
        evidence.update({k: f[k] for k in ("exit_code", "signal") if f.get(k) is not None})
    if evidence:
        origin["evidence"] = evidence
    return Origin(ev, origin)


def comm_origin(events: Events, inc: Incident) -> Origin:
    """A communication incident's origin: its first failure; the rank they name, when that
    rank printed nothing in it (see the module docstring)."""
    ev = events.earliest(inc.id, SYMPTOM_KINDS) or events.earliest(inc.id)
    if ev is None:
        return Origin(None, {})
    origin = origin_of(ev)
    named = _named(events, inc.id)
    spoke = events.ranks(inc.id)
    silent = [r for r in named if r not in spoke]  # in the order they were first named
    if silent:
        rank = max(silent, key=lambda r: len(named[r]))  # max keeps the first of equals
        origin["evidence"] = {
            "named_by": sorted(named[rank]),
            "silent": True,
            "first_seen_rank": origin["rank"],
        }
        origin["rank"] = rank
    return Origin(ev, origin)


def _named(events: Events, incident_id: int) -> dict[int, set[int]]:
    """{rank named as the peer waited for: the ranks that named it}, first named first."""
    out: dict[int, set[int]] = {}
    for remote, rank in events.named_peers(incident_id):
        try:
            named = int(remote)
        except (TypeError, ValueError):
            continue
        namers = out.setdefault(named, set())
        if rank is not None and rank != named:
            namers.add(rank)
    return out


for _kind in ("oom", "process_failure"):
    register(_kind)(root_event_origin)
for _kind in SYMPTOM_KINDS:
    register(_kind)(comm_origin)
