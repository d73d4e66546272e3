"""An incident's title and short story: what happened where, and what followed from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field

from .._dc import dataclass
from ..events import parse_utc, ranks_text
from ..store.events import Events, KindGroup
from ..store.records import JSON, Run


@dataclass
class Story:
    title: str
    detail: dict[str, JSON] = field(default_factory=dict)


def _at(o: Mapping[str, JSON]) -> str:
    if o.get("epoch") is not None and o.get("iter") is not None:
        return f"epoch {o['epoch']} iter {o['iter']}"
    if o.get("step") is not None:
        return f"step {o['step']}"
    return ""


_STAGE_WORD = {"train": "training", "val": "validation", "test": "testing"}


@dataclass
class _Kind:
    """An incident's events of one kind, over its ranks."""

    ranks: set[int] = field(default_factory=set)
    count: int = 0
    first: str | None = None
    backends: set[str] = field(default_factory=set)
    codes: set[str] = field(default_factory=set)
    remote: set[str] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)


def _composition(groups: list[KindGroup]) -> dict[str, _Kind]:
    by_kind: dict[str, _Kind] = {}
    for g in groups:
        k = by_kind.setdefault(g.kind, _Kind())
        if g.rank is not None:
            k.ranks.add(g.rank)
        k.count += g.count
        if g.first_time and (k.first is None or g.first_time < k.first):
            k.first = g.first_time
        k.backends.update(g.backends)
        k.codes.update(g.codes)
        k.remote.update(g.remote)
        k.nodes.update(g.nodes)
    return by_kind


def describe(
    events: Events,
    incident_id: int,
    kind: str,
    origin: Mapping[str, JSON],
    run: Run | None,
) -> Story:
    comp = _composition(events.composition(incident_id))
    rank = origin.get("rank")
    stage = origin.get("stage")
    at = _at(origin)
    run_name = run.name if run is not None else None
    suffix = f" (run {run_name})" if run_name else ""
    detail: dict[str, JSON] = {}
    evidence = origin.get("evidence") or {}
    where = ", ".join(
        x
        for x in (f"rank {rank}" if rank is not None else "", at, _STAGE_WORD.get(stage or "", ""))
        if x
    )

    symptoms = {k: v for k, v in comp.items() if k in ("comm_timeout", "comm_error")}
    if kind == "oom":
        title = "Out of memory" + (f" on rank {rank}" if rank is not None else "")
        if stage:
            title += f" in {_STAGE_WORD.get(stage, stage)}"
        if at:
            title += f" ({at})"
        detail["root_cause"] = (
            f"{'Rank ' + str(rank) if rank is not None else 'A rank'} ran out of device memory"
            + (f" during {_STAGE_WORD.get(stage, stage)}" if stage else "")
            + (f" ({at})" if at else "")
            + "."
        )
    elif kind == "process_failure":
        signal = evidence.get("signal")
        title = "Process failure" + (f" of rank {rank}" if rank is not None else "")
        title += f" ({signal})" if signal else ""
        detail["root_cause"] = (
            f"{'Rank ' + str(rank) if rank is not None else 'A process'} exited abnormally"
            + (f" ({at})" if at else "")
            + (
                ": killed by SIGKILL, often the host's out-of-memory killer (check dmesg on "
                "its node)"
                if signal == "SIGKILL"
                else f" ({signal})"
                if signal
                else ""
            )
            + "."
            + (
                f" Ranks {ranks_text(evidence['named_by'])} named it as the peer they waited for."
                if evidence.get("named_by")
                else ""
            )
        )
    elif kind == "nan":
        tensor = origin.get("tensor")
        title = f"Non-finite {tensor}" if tensor else "Non-finite values"
        if where:
            title += f" first on {where}"
        if not origin.get("tag"):
            # tensor findings (msprobe) come with their own story from the nan origin
            detail["root_cause"] = (
                "The first non-finite value appeared"
                + (f" on rank {rank}" if rank is not None else "")
                + (f" at {at}" if at else "")
                + (f" in {tensor}" if tensor else "")
                + "."
            )
    elif kind in ("comm_timeout", "comm_error"):
        info = comp.get(kind, _Kind())
        backends = "/".join(sorted(b.upper() for b in info.backends)) or "collective"
        codes = ", ".join(sorted(info.codes))
        what = "timeout" if kind == "comm_timeout" else "error"
        title = f"{backends} {what} on ranks {ranks_text(info.ranks)}"
        if codes:
            title += f" ({codes})"
        remote = sorted(info.remote)
        if evidence.get("silent"):
            # the waiting ranks name one that printed nothing: it is the root (see origin.py)
            title = f"Rank {rank} stopped responding: {title}"
            detail["cause_rank"] = rank
            detail["root_cause"] = (
                f"Rank {rank} stopped responding: ranks {ranks_text(evidence['named_by'])} "
                f"named it as the peer they waited for, and nothing from rank {rank} itself is "
                f"in these logs. These ranks waited for rank {rank} in a collective; look for "
                "its own end: its log on its node, the launcher's report of its exit, the "
                "host's out-of-memory killer (dmesg), a lost node."
            )
        elif remote:
            title += f", waiting for rank {','.join(remote)}"
            detail["cause_rank"] = _int(remote[0])
            detail["root_cause"] = (
                f"These ranks waited for rank {','.join(remote)} in a collective; look for "
                f"that rank's own failure (on another node, or not in these logs)."
            )
        else:
            detail["root_cause"] = (
                "A collective did not complete; the rank that failed first is not in these logs."
            )
    elif kind == "slowdown":
        title = "Step time slowdown"
        ratio = origin.get("ratio")
        if ratio:
            title += f": {ratio:.1f}x"
    else:
        title = {"overflow": "Loss-scale overflow", "data_issue": "Training data issue"}.get(
            kind, kind
        )
        if where:
            title += f" on {where}"

    if symptoms and kind in ("oom", "process_failure"):
        sym_ranks: set[int] = set()
        sym_backends: set[str] = set()
        sym_codes: set[str] = set()
        sym_nodes: set[str] = set()
        first_sym = None
        for v in symptoms.values():
            sym_ranks |= v.ranks
            sym_nodes |= v.nodes
            sym_backends |= {b.upper() for b in v.backends}
            sym_codes |= v.codes
            if v.first and (first_sym is None or v.first < first_sym):
                first_sym = v.first
        other = sorted(sym_ranks - ({rank} if rank is not None else set()))
        bk = "/".join(sorted(sym_backends)) or "collective"
        if other:
            title += f"; {len(other)} other rank{'s' if len(other) != 1 else ''}"
            if len(sym_nodes) > 1:
                # a fleet's story: how far the failure reached
                title += f" on {len(sym_nodes)} nodes"
                detail["symptom_nodes"] = len(sym_nodes)
            title += " then timed out" if "comm_timeout" in symptoms else " then failed"
            title += f" in {bk}" if sym_backends else ""
        delay = _delay(origin.get("time"), first_sym)
        detail["root_cause"] = (
            detail.get("root_cause", "")
            + f" Ranks {ranks_text(other)} then "
            + ("timed out" if "comm_timeout" in symptoms else "failed")
            + f" in {bk}"
            + (f" ({', '.join(sorted(sym_codes))})" if sym_codes else "")
            + (f" about {delay} later" if delay else "")
            + ": the timeouts are a symptom of this failure, not a network problem."
        ).strip()
        detail["symptom_ranks"] = other
        detail["symptoms"] = sorted(symptoms)
    exits = comp.get("process_failure")
    if exits and kind != "process_failure":
        # launcher reports of exits this failure caused (a watchdog aborting its process, the
        # root's own exception): effects, said as such
        comm = kind in ("comm_timeout", "comm_error")
        exited = sorted(exits.ranks - ({rank} if rank is not None and not comm else set()))
        if exited:
            detail["exited_ranks"] = exited
            detail["root_cause"] = (
                detail.get("root_cause", "")
                + f" Ranks {ranks_text(exited)} then exited"
                + (" (their watchdogs took the processes down)" if comm else "")
                + ": the launcher's reports of their exits are effects of this failure."
            ).strip()
    if kind == "nan":
        nan = comp.get("nan")
        if nan and rank is not None and len(nan.ranks) > 1:
            detail["followed_on_ranks"] = sorted(nan.ranks - {rank})
    return Story(title + suffix, detail)


def _int(x: str) -> int | str:
    try:
        return int(x)
    except ValueError:
        return x


def _delay(t0: JSON, t1: str | None) -> str:
    if not t0 or not t1:
        return ""
    try:
        d = parse_utc(str(t1)) - parse_utc(str(t0))
    except ValueError:
        return ""
    if d < 1:
        return ""
    if d >= 90:
        return f"{d / 60:.0f} min ({d:.0f} s)"
    return f"{d:.0f} s"
