"""Events -> incidents with one root cause.

The correlator reads the events committed since its last pass and attaches each to an incident
of its run. Events are grouped by a fingerprint (the kind, plus the normalised message for
open-ended kinds; a run's communication timeouts and errors by backend); a root cause absorbs
its symptoms (see ``chains.py``): collective timeouts on the other ranks, the launcher's report
that the rank died; an exit a rank's own communication failure caused follows that failure
(``effects.py``). Every material change bumps the incident's ``version`` and is returned as a
:class:`Change` for the outbox.

Lifecycle: ``open`` -> ``resolved`` when the run recovers (finite losses again after a NaN) or,
under ``watch``, after a quiet period; a recurrence later opens a new incident. Incidents
absorbed into another one become ``merged``. ``scan`` never resolves an incident because its
input ended.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..events import format_utc, now_utc
from ..store.db import Store
from ..store.metrics import Metrics
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

_NUM = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")
_PATH = re.compile(r"(?:/[\w.\-]+)+")
_WS = re.compile(r"\s+")

# Kinds whose events of one run are always one incident, whatever their text.
_ONE_PER_RUN = {"nan", "oom", "process_failure", "slowdown", "data_issue", "overflow"}
RECOVERY_ITERATIONS = 20  # finite logged losses after the last NaN that mean "recovered"


def fingerprint(kind: str, message: str, fields: Mapping[str, Any]) -> str:
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

    incident: dict[str, Any]
    new_events: list[dict[str, Any]] = field(default_factory=list)
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
        knowledge: Any = None,
        resolve_after: float | None = None,
    ) -> None:
        self.store = store
        self.timeouts = timeouts or Timeouts()
        self.knowledge = knowledge
        self.resolve_after = resolve_after
        self._pending_changes: list[Change] = []
        self._relaunch_upto: Any = None  # (metrics, incidents) ids relaunches were looked at

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
            batch = self.store.events_after(last, limit=20000)
            if not batch:
                break
            with self.store.transaction():
                changes.extend(self._apply(batch))
                last = batch[-1]["id"]
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
                exists = self.store.conn.execute(
                    "SELECT 1 FROM events WHERE run_id = ? AND kind = 'slowdown' LIMIT 1",
                    (run_id,),
                ).fetchone()
                if exists:
                    continue  # one finding per run; its incident tracks what follows
                self.store.insert_events(
                    run_id, finding.at.source_id, [slowdown.to_event(finding)], now_utc()
                )

    # -- one batch -------------------------------------------------------------------------------

    def _apply(self, events: Iterable[dict[str, Any]]) -> list[Change]:
        accs: dict[int, _Acc] = {}
        self._pending_changes = []

        # roots first, so their symptoms in the same batch find them
        def rank_of_kind(e: Mapping[str, Any]) -> tuple[int, int]:
            k = e["kind"]
            if may_be_torn_down(e):
                return (3, e["id"])  # after the communication failures it may follow from
            return (0 if k in ROOT_KINDS else 2 if k in SYMPTOM_KINDS else 1, e["id"])

        touched_runs: set[Any] = set()
        data_runs: set[Any] = set()
        for ev in sorted(events, key=rank_of_kind):
            if ev["fields"].get("incident") is False:
                if ev["kind"] == "data_issue":
                    data_runs.add(ev["run_id"])
                continue  # kept as an event, not incident-worthy on its own (e.g. early overflow)
            inc = None
            if may_be_torn_down(ev):
                inc = self._comm_incident_for(ev, accs)
            if inc is None and (ev["kind"] in SYMPTOM_KINDS or ev["kind"] == "process_failure"):
                inc = self._root_for(ev, accs)
            if inc is None:
                key = fingerprint(ev["kind"], ev["message"], ev["fields"])
                inc = self._open_incident(ev["run_id"], key, accs)
                if inc is None and ev["kind"] in ("comm_timeout", "comm_error"):
                    inc = self._comm_sibling(ev["run_id"], key, accs)
                if inc is None:
                    inc = self._create(ev, key)
                    accs[inc["id"]] = _Acc(inc, created=True)
            acc = accs.setdefault(inc["id"], _Acc(inc))
            acc.new_events.append(ev)
            if ev["kind"] in ROOT_KINDS or ev["kind"] in SYMPTOM_KINDS:
                touched_runs.add(ev["run_id"])
        for run_id in data_runs:
            # samples reported after the NaN's incident opened (another rank's file read later)
            inc = self._open_incident(run_id, "nan", accs)
            if inc is not None:
                accs.setdefault(inc["id"], _Acc(inc))
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

    def _root_for(self, ev: Mapping[str, Any], accs: Mapping[int, _Acc]) -> dict[str, Any] | None:
        """The open root-cause incident this symptom follows from, if any."""
        timeouts = self._timeouts(ev["run_id"])
        for root in roots_of_run(self.store.conn, ev["run_id"]):
            if root.kind == ev["kind"] or effects.torn_down_by(self.store.conn, root, ev):
                continue  # the root's exit is this failure's effect, not its cause
            if ev["kind"] == "process_failure":
                if root.kind != "oom" or not absorbs(root, _as_root(ev)):
                    continue
            elif not links(root, ev, timeouts):
                continue
            acc = accs.get(root.incident_id)
            return acc.incident if acc else self._load(root.incident_id)
        return None

    def _comm_incident_for(
        self, ev: Mapping[str, Any], accs: Mapping[int, _Acc]
    ) -> dict[str, Any] | None:
        """A worker that exited with an exception or an abort shortly after a communication
        failure on its own rank (an NCCL/HCCL error raised in it, a watchdog taking the process
        down, then torchrun's report) failed because of that failure: its exit joins the
        failure's incident, whatever that incident's root is."""
        for acc in accs.values():
            for other in acc.new_events:
                if other["run_id"] == ev["run_id"] and torn_down(ev, other):
                    return acc.incident
        for other in effects.comm_events_of(self.store.conn, ev):
            if torn_down(ev, other):
                held = accs.get(other["incident_id"])
                inc = held.incident if held else self._load(other["incident_id"])
                if inc is not None and inc["status"] == "open":
                    return inc
        return None

    def _absorb_orphans(self, run_id: Any, accs: dict[int, _Acc]) -> None:
        """A root that arrived after its symptoms takes them over; a process failure whose
        cause arrived after it (its own rank's watchdog timeout) joins that cause."""
        while (pair := effects.next_effect(self.store.conn, run_id)) is not None:
            self._merge(*pair, accs)
        roots = roots_of_run(self.store.conn, run_id)
        if not roots:
            return
        timeouts = self._timeouts(run_id)
        rows = self.store.conn.execute(
            "SELECT id, kind FROM incidents WHERE run_id IS ? AND status = 'open' "
            "AND kind IN ('comm_timeout', 'comm_error', 'process_failure') ORDER BY id",
            (run_id,),
        ).fetchall()
        for iid, kind in rows:
            evs = [
                Store._event(r)
                for r in self.store.conn.execute(
                    "SELECT id, kind, time, ingested_at, run_id, source_id, offset, key, line, "
                    "rank, local_rank, node, epoch, iter, step, stage, device, message, fields, "
                    "incident_id FROM events WHERE incident_id = ? ORDER BY id LIMIT 200",
                    (iid,),
                )
            ]
            if not evs:
                continue
            for root in roots:
                if root.incident_id == iid:
                    continue
                if kind == "process_failure":
                    ok = root.kind == "oom" and absorbs(root, _as_root(evs[0]))
                else:
                    ok = any(links(root, e, timeouts) for e in evs)
                if ok:
                    self._merge(iid, root.incident_id, accs)
                    break

    def _merge(self, src: int, dst: int, accs: dict[int, _Acc]) -> None:
        self.store.execute("UPDATE events SET incident_id = ? WHERE incident_id = ?", (dst, src))
        src_acc = accs.pop(src, None)
        was_new = src_acc is not None and src_acc.created
        if was_new:
            self.store.execute("DELETE FROM incidents WHERE id = ?", (src,))
        else:
            row = self.store.conn.execute(
                "SELECT version, detail FROM incidents WHERE id = ?", (src,)
            ).fetchone()
            detail = json.loads(row[1] or "{}") if row else {}
            detail["merged_into"] = dst
            self.store.execute(
                "UPDATE incidents SET status = 'merged', detail = ?, version = version + 1, "
                "updated_at = ?, resolved_at = ? WHERE id = ?",
                (json.dumps(detail), now_utc(), now_utc(), src),
            )
            self._pending_changes.append(
                Change(src, "update", (row[0] if row else 0) + 1, [f"merged into incident #{dst}"])
            )
        acc = accs.get(dst)
        if acc is None:
            inc = self._load(dst)
            if inc is None:
                return
            acc = accs[dst] = _Acc(inc)
        acc.recount = True

    def _open_incident(
        self, run_id: int, key: str, accs: Mapping[int, _Acc]
    ) -> dict[str, Any] | None:
        for acc in accs.values():
            inc = acc.incident
            if inc["run_id"] == run_id and inc["key"] == key and inc["status"] == "open":
                return inc
        row = self.store.conn.execute(
            "SELECT * FROM incidents WHERE run_id IS ? AND key=? AND status='open' "
            "ORDER BY id DESC LIMIT 1",
            (run_id, key),
        ).fetchone()
        return _incident(self.store, row) if row else None

    def _comm_sibling(
        self, run_id: int, key: str, accs: Mapping[int, _Acc]
    ) -> dict[str, Any] | None:
        """Communication incidents are one per backend, but not every line names its backend
        (one rank's heartbeat report says NCCL, another's does not): an event whose backend is
        unknown joins its run's one open communication incident, and one that names its
        backend joins an open one whose backend was unknown."""
        if not key.endswith(":"):
            return self._open_incident(run_id, "comm:", accs)
        ids = [
            r[0]
            for r in self.store.conn.execute(
                "SELECT id FROM incidents WHERE run_id IS ? AND key LIKE 'comm:%' "
                "AND status = 'open'",
                (run_id,),
            )
        ]
        if len(ids) != 1:
            return None
        acc = accs.get(ids[0])
        return acc.incident if acc else self._load(ids[0])

    def _load(self, incident_id: int) -> dict[str, Any] | None:
        row = self.store.conn.execute(
            "SELECT * FROM incidents WHERE id = ?", (incident_id,)
        ).fetchone()
        return _incident(self.store, row) if row else None

    def _create(self, ev: Mapping[str, Any], key: str) -> dict[str, Any]:
        now = now_utc()
        origin = origin_of(ev)
        cur = self.store.execute(
            "INSERT INTO incidents(run_id, kind, key, title, status, ranks, first_time, "
            "last_time, event_count, origin, hints, detail, root_event_id, version, created_at, "
            "updated_at) VALUES (?,?,?,?,'open','[]',?,?,0,?,'[]','{}',?,0,?,?)",
            (
                ev["run_id"],
                ev["kind"],
                key,
                ev["message"][:200],
                ev["time"],
                ev["time"],
                json.dumps(origin),
                ev["id"],
                now,
                now,
            ),
        )
        inc = self._load(int(cur.lastrowid or 0))
        assert inc is not None
        inc["origin"] = {}  # so the first update reports the origin as news-free
        return inc

    def _attach(self, acc: _Acc) -> None:
        iid = acc.incident["id"]
        self.store.conn.executemany(
            "UPDATE events SET incident_id=? WHERE id=?", [(iid, e["id"]) for e in acc.new_events]
        )

    def _update(self, acc: _Acc) -> Change | None:
        inc = acc.incident
        iid = inc["id"]
        if acc.recount:
            row = self.store.conn.execute(
                "SELECT count(*), min(time), max(time) FROM events WHERE incident_id = ?", (iid,)
            ).fetchone()
            count, first, last = row
            ranks = {
                r
                for (r,) in self.store.conn.execute(
                    "SELECT DISTINCT rank FROM events WHERE incident_id = ? AND rank IS NOT NULL",
                    (iid,),
                )
            }
            nodes = {
                n
                for (n,) in self.store.conn.execute(
                    "SELECT DISTINCT node FROM events WHERE incident_id = ? AND node IS NOT NULL",
                    (iid,),
                )
            }
        else:
            ranks = set(inc["ranks"])
            ranks.update(e["rank"] for e in acc.new_events if e.get("rank") is not None)
            nodes = set(inc["detail"].get("nodes") or [])
            nodes.update(e["node"] for e in acc.new_events if e.get("node"))
            times = [t for t in (inc["first_time"], inc["last_time"]) if t]
            times += [
                e["time"] or e["fields"].get("stream_time")
                for e in acc.new_events
                if e.get("time") or e["fields"].get("stream_time")
            ]
            first, last = (min(times), max(times)) if times else (None, None)
            count = inc["event_count"] + len(acc.new_events)
        origin_ev, origin = origin_for(inc["kind"])(self.store.conn, iid)
        run = self._run(inc["run_id"])
        story = describe(self.store.conn, iid, inc["kind"], origin, run)
        # an origin function may have written its own story into the row (the NaN one does)
        row = self.store.conn.execute("SELECT detail FROM incidents WHERE id=?", (iid,)).fetchone()
        detail = {**json.loads(row[0] or "{}"), **story.detail}
        detail["nodes"] = sorted(nodes)  # where its events were read (several when merged)
        if inc["kind"] == "nan":
            related = samples.related(self.store, inc["run_id"], origin)
            if related:
                detail["related_data_issues"] = related
        hints = (
            self.knowledge.hints_for(self.store.conn, iid, inc["kind"], origin, detail, run)
            if self.knowledge is not None
            else inc.get("hints", [])
        )
        news = list(acc.news)
        added = sorted(ranks - set(inc["ranks"]))
        if added and not acc.created:
            news.append("ranks " + ",".join(str(r) for r in added) + " affected")
        if inc["origin"] and _where(origin) != _where(inc["origin"]):
            news.append("origin moved to " + _where(origin))
        if (
            detail.get("root_cause")
            and detail.get("root_cause") != inc.get("detail", {}).get("root_cause")
            and not acc.created
        ):
            news.append("root cause: " + str(detail["root_cause"]))
        material = acc.created or bool(news) or story.title != inc["title"]
        version = inc["version"] + 1 if material else inc["version"]
        self.store.execute(
            "UPDATE incidents SET ranks=?, first_time=?, last_time=?, event_count=?, origin=?, "
            "title=?, root_event_id=?, detail=?, hints=?, version=?, updated_at=? WHERE id=?",
            (
                json.dumps(sorted(ranks)),
                first,
                last,
                count,
                json.dumps(origin),
                story.title,
                origin_ev["id"] if origin_ev else inc["root_event_id"],
                json.dumps(detail),
                json.dumps(hints),
                version,
                now_utc(),
                iid,
            ),
        )
        if not material:
            return None
        return Change(iid, "open" if acc.created else "update", version, news)

    def _timeouts(self, run_id: Any) -> Timeouts:
        """The config's collective timeouts, else those the run's facts say were in force."""
        return self.timeouts.with_facts(self._run(run_id).get("facts") or {})

    def _run(self, run_id: Any) -> dict[str, Any]:
        row = self.store.conn.execute(
            "SELECT id, name, experiment, facts, root FROM runs WHERE id IS ?", (run_id,)
        ).fetchone()
        if not row:
            return {}
        return {
            "id": row[0],
            "name": row[1],
            "experiment": row[2],
            "facts": json.loads(row[3] or "{}"),
            "root": row[4],
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def _recoveries(self) -> list[Change]:
        """NaN incidents whose run logs finite losses again for a while are resolved."""
        out: list[Change] = []
        rows = self.store.conn.execute(
            "SELECT i.id, i.run_id, i.version, i.detail, "
            "(SELECT max(step) FROM events e WHERE e.incident_id = i.id) "
            "FROM incidents i WHERE i.status = 'open' AND i.kind = 'nan'"
        ).fetchall()
        for iid, run_id, version, detail_json, last_step in rows:
            if last_step is None:
                continue
            n = Metrics(self.store).trained_after(run_id, last_step)
            if n >= RECOVERY_ITERATIONS:
                detail = json.loads(detail_json or "{}")
                detail["resolution"] = (
                    f"the loss was finite for {n} logged iterations after step {last_step}"
                )
                out.append(self._resolve(iid, version, detail))
        return out

    def _relaunched(self) -> list[Change]:
        """Open incidents that a later run of the same experiment trained past: its training
        reached a step beyond the incident's origin step (or an epoch beyond its epoch)."""
        out: list[Change] = []
        # only new step counts (or new incidents) can change the answer: look again then
        newest = (
            Metrics(self.store).last_block(),
            self.store.conn.execute("SELECT max(id) FROM incidents").fetchone()[0],
        )
        if newest == self._relaunch_upto:
            return out
        self._relaunch_upto = newest
        rows = self.store.conn.execute(
            "SELECT i.id, i.version, i.detail, i.origin, r.id, r.experiment FROM incidents i "
            "JOIN runs r ON r.id = i.run_id WHERE i.status = 'open' AND r.experiment IS NOT NULL"
        ).fetchall()
        for iid, version, detail_json, origin_json, run_id, experiment in rows:
            origin = json.loads(origin_json or "{}")
            step, epoch = origin.get("step"), origin.get("epoch")
            if step is None and epoch is None:
                continue
            later = self.store.conn.execute(
                "SELECT id, name FROM runs WHERE experiment = ? AND id > ? ORDER BY id",
                (experiment, run_id),
            ).fetchall()
            for later_id, name in later:
                # a step counts when it trained: its loss is finite
                max_step, max_epoch = Metrics(self.store).trained_to(later_id)
                if max_step is None and max_epoch is None:
                    continue
                if step is not None and max_step is not None and max_step > step:
                    past = f"step {max_step}, past the incident's step {step}"
                elif step is None and max_epoch is not None and max_epoch > epoch:
                    past = f"epoch {max_epoch}, past the incident's epoch {epoch}"
                else:
                    continue
                detail = json.loads(detail_json or "{}")
                detail["resolution"] = (
                    f"{name}, a relaunch of the same experiment, trained to {past}"
                )
                detail["resolved_by_run"] = name
                out.append(self._resolve(iid, version, detail))
                break
        return out

    def _resolve_quiet(self, now: float) -> list[Change]:
        assert self.resolve_after is not None
        cutoff = format_utc(now - self.resolve_after)
        rows = self.store.conn.execute(
            "SELECT id, version, detail FROM incidents WHERE status = 'open' AND updated_at < ?",
            (cutoff,),
        ).fetchall()
        out = []
        for iid, version, detail_json in rows:
            detail = json.loads(detail_json or "{}")
            detail["resolution"] = (
                f"no new events for {int(self.resolve_after)} s while nanwatch was watching"
            )
            out.append(self._resolve(iid, version, detail))
        return out

    def _resolve(self, iid: int, version: int, detail: Mapping[str, Any]) -> Change:
        now = now_utc()
        self.store.execute(
            "UPDATE incidents SET status = 'resolved', resolved_at = ?, updated_at = ?, "
            "version = ?, detail = ? WHERE id = ?",
            (now, now, version + 1, json.dumps(detail), iid),
        )
        return Change(iid, "resolve", version + 1, [str(detail.get("resolution", "resolved"))])


def _as_root(ev: Mapping[str, Any]) -> Root:
    from .chains import event_time

    ranks = {ev["rank"]} if ev.get("rank") is not None else set()
    for r in (ev.get("fields") or {}).get("failed_ranks") or ():
        if isinstance(r, int):
            ranks.add(r)
    return Root(ev["id"], ev["kind"], ev.get("rank"), frozenset(ranks), event_time(ev))


def _where(origin: Mapping[str, Any]) -> str:
    parts = [f"{k} {origin[k]}" for k in ("rank", "step", "tensor") if origin.get(k) is not None]
    return ", ".join(parts)


def _incident(store: Store, row: Any) -> dict[str, Any]:
    d = store._row(row, "incidents")
    for k in ("ranks", "origin", "hints", "detail"):
        d[k] = json.loads(d[k] or ("[]" if k in ("ranks", "hints") else "{}"))
    return d
