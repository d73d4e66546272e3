"""Causal chains: a root cause on one rank, symptoms on the others.

When a rank dies (out of memory, a crash), the other ranks wait in their next collective until
it times out: HCCL after ``HCCL_EXEC_TIMEOUT`` (1800 s by default), NCCL after the process
group's timeout (10 or 30 minutes, printed as ``Timeout(ms)=``). Those timeouts are symptoms.
A symptom joins a root when it names the root's rank (EI0002 ``remote rank [3]``), or when it
happened within one collective timeout (plus a margin) after the root.

Cause and effect go both ways, by evidence rather than by a ranking of kinds. A collective
watchdog that times out takes its own process down (PyTorch's NCCL watchdog: "To avoid data
inconsistency, we are taking the entire process down", an abort, SIGABRT); the launcher then
reports that rank's exit. Such an exit is an effect of the timeout on its own rank
(:func:`torn_down`), and follows that timeout into whatever incident the timeout belongs to (its
own, or the OOM on another rank it waited for). An exit from outside the process (SIGKILL from
the host's OOM killer, a segfault) stays a root.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._dc import dataclass
from ..events import parse_utc
from ..store.incidents import Incidents
from ..store.records import JSON, StoredEvent

ROOT_KINDS = ("oom", "process_failure")  # in priority order: an OOM absorbs its process failure
SYMPTOM_KINDS = ("comm_timeout", "comm_error")
DEFAULT_TIMEOUT = {"hccl": 1800.0, "nccl": 1800.0, "gloo": 1800.0}
MARGIN_BEFORE = 300.0  # clocks of different nodes and log buffering
# from a watchdog's timeout to the launcher's report of the abort: the abort is immediate, but
# the heartbeat monitor may first dump debug info and the launcher polls its children
TEARDOWN_AFTER = 900.0
_ABORT_CODES = (-6, 134)  # killed by SIGABRT; 128 + 6 as a shell reports it


@dataclass(frozen=True)
class Timeouts:
    """Collective timeouts in force, from the config or the run's facts (seconds)."""

    hccl: float | None = None
    nccl: float | None = None

    def for_backend(self, backend: str | None, event_timeout_ms: JSON = None) -> float:
        if isinstance(event_timeout_ms, (int, float)) and event_timeout_ms > 0:
            return float(event_timeout_ms) / 1000.0
        b = (backend or "").lower()
        if b == "hccl" and self.hccl:
            return self.hccl
        if b == "nccl" and self.nccl:
            return self.nccl
        return DEFAULT_TIMEOUT.get(b, 1800.0)

    def with_facts(self, facts: Mapping[str, JSON]) -> Timeouts:
        """These (configured) timeouts, else those the run said were in force (its facts):
        ``HCCL_EXEC_TIMEOUT`` for HCCL; ``NCCL_TIMEOUT``, else the process group's timeout of
        an NCCL group, for NCCL."""
        told = facts.get("timeouts") if isinstance(facts, Mapping) else None
        if not isinstance(told, Mapping):
            return self
        hccl = self.hccl or _seconds(told.get("HCCL_EXEC_TIMEOUT"))
        nccl = self.nccl or _seconds(told.get("NCCL_TIMEOUT"))
        if not nccl and "nccl" in str(facts.get("backend") or ""):
            nccl = _seconds(told.get("pg_timeout"))
        return Timeouts(hccl, nccl)


def _seconds(v: JSON) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    return None


def event_time(ev: StoredEvent) -> float | None:
    """The event's own time, else the last time its stream printed (tracebacks have none)."""
    t = ev.time or ev.fields.get("stream_time")
    if not t:
        return None
    try:
        return parse_utc(str(t))
    except ValueError:
        return None


def exception_exit(ev: StoredEvent) -> bool:
    """A process failure that is an ordinary non-zero exit (an exception), not a signal."""
    if ev.kind != "process_failure":
        return False
    f = ev.fields
    code = f.get("exit_code")
    return isinstance(code, int) and code > 0 and not f.get("signal") and not f.get("reason")


def _aborted(f: Mapping[str, JSON]) -> bool:
    code = f.get("exit_code")
    return (
        f.get("signal") == "SIGABRT"
        or (isinstance(code, int) and code in _ABORT_CODES)
        or str(f.get("reason") or "").lower() in _ABORT_REASONS
    )


# how the shell and the C runtime say a process aborted (bash's zh_CN catalogue: 已放弃)
_ABORT_REASONS = frozenset(("aborted", "abort", "已放弃"))


def may_be_torn_down(ev: StoredEvent) -> bool:
    """A process failure that a communication failure of its own process can explain: an
    exception, an abort (what a watchdog does), or a report that does not say how it ended
    (``ChildFailedError``). Signals from outside (SIGKILL, SIGTERM) and crashes cannot."""
    if ev.kind != "process_failure" or ev.device:
        return False  # a kernel that faulted on the device is a crash of its own
    f = ev.fields
    if exception_exit(ev) or _aborted(f):
        return True
    return f.get("exit_code") is None and not f.get("signal") and not f.get("reason")


def same_process(a: StoredEvent, b: StoredEvent) -> bool:
    """Could two events come from one process (same rank, else same local rank on one node)?
    An event that names no rank may be any of them."""
    ra, rb = a.rank, b.rank
    if ra is not None and rb is not None:
        return bool(ra == rb)
    la = ra if ra is not None else a.local_rank
    lb = rb if rb is not None else b.local_rank
    if la is None or lb is None:
        return True
    na, nb = a.node, b.node
    return bool(la == lb and (not na or not nb or na == nb))


def torn_down(effect: StoredEvent, cause: StoredEvent) -> bool:
    """Did communication failure ``cause`` take the process of ``effect`` (a process
    failure) down? Same process, the exit at or shortly after the failure; when a time is
    missing, the same process is the evidence."""
    if cause.kind not in SYMPTOM_KINDS or not may_be_torn_down(effect):
        return False
    e_lo, e_hi = _bounds(effect)
    c_lo, c_hi = _bounds(cause)
    if not same_process(effect, cause):
        return _aborted_after(effect, cause, e_lo, c_lo)
    # 5 s: two clocks of one node (the launcher's and the worker's log lines)
    if e_hi is not None and c_lo is not None and e_hi < c_lo - 5.0:
        return False  # the exit came before the failure
    return not (e_lo is not None and c_hi is not None and e_lo > c_hi + TEARDOWN_AFTER)


def _aborted_after(
    effect: StoredEvent, cause: StoredEvent, e_lo: float | None, c_lo: float | None
) -> bool:
    """An abort (SIGABRT: what a collective watchdog does) of another rank, reported after a
    watchdog's timeout: every rank in a hung collective times out, and a launcher that saw a
    rank crash first would have ended the others before their timeouts came. After: by time
    when both have one, else by line order in one file (the launcher and the workers print to
    the same stream)."""
    if not _aborted(effect.fields):
        return False
    if e_lo is not None and c_lo is not None:
        return c_lo - 5.0 <= e_lo <= c_lo + TEARDOWN_AFTER
    if effect.source_id is None or effect.source_id != cause.source_id:
        return False
    return effect.line is not None and cause.line is not None and effect.line > cause.line


def _bounds(ev: StoredEvent) -> tuple[float | None, float | None]:
    """When the event happened, at the earliest and the latest: its own time is both; a
    line without one happened after the last time its stream printed (a lower bound)."""
    t = event_time(ev)
    return t, (t if ev.time else None)


@dataclass(frozen=True)
class Root:
    incident_id: int
    kind: str
    rank: int | None
    ranks: frozenset[int]
    time: float | None
    event_id: int | None = None


def roots_of_run(incidents: Incidents, run_id: int | None) -> list[Root]:
    """Open root-cause incidents of a run, earliest first, with their root event's time."""
    out = []
    for inc in incidents.open_of_kinds(run_id, ROOT_KINDS):
        origin = inc.origin
        t = origin.get("time")
        when = parse_utc(t) if t else None
        out.append(
            Root(
                inc.id,
                inc.kind,
                origin.get("rank"),
                frozenset(inc.ranks),
                when,
                origin.get("event_id"),
            )
        )
    out.sort(key=lambda r: (ROOT_KINDS.index(r.kind), r.time or 0.0, r.incident_id))
    return out


def links(
    root: Root, ev: StoredEvent, timeouts: Timeouts, root_event: StoredEvent | None = None
) -> bool:
    """Does symptom event ``ev`` follow from ``root`` (whose own event is ``root_event``)?"""
    fields = ev.fields
    remote = fields.get("remote_rank")
    if remote is not None and root.rank is not None:
        try:
            if int(remote) == root.rank or int(remote) in root.ranks:
                return True
        except (TypeError, ValueError):
            pass
    for failed in fields.get("failed_ranks") or ():
        if failed == root.rank:
            return True
    t = event_time(ev)
    if t is None or root.time is None:
        # no clocks to compare: the order one stream printed them in is the evidence left (a
        # timeout printed before the failure's own report in the same log did not follow from
        # it); otherwise the one root of the run explains it
        return not printed_before(ev, root_event)
    window = timeouts.for_backend(fields.get("backend"), fields.get("timeout_ms"))
    return root.time - MARGIN_BEFORE <= t <= root.time + window * 1.2 + MARGIN_BEFORE


def printed_before(ev: StoredEvent, other: StoredEvent | None) -> bool:
    """Was ``ev`` printed before ``other`` in the same stream?"""
    return (
        other is not None
        and other.source_id is not None
        and ev.source_id == other.source_id
        and ev.offset < other.offset
    )


def absorbs(root: Root, other: Root) -> bool:
    """An OOM absorbs the process failure of its own rank (the launcher reporting it died)."""
    if root.kind != "oom" or other.kind != "process_failure":
        return False
    if root.rank is not None and other.ranks and root.rank not in other.ranks:
        return False
    if root.time is None or other.time is None:
        return True
    return root.time - MARGIN_BEFORE <= other.time <= root.time + 3600.0
