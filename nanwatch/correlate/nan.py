"""The ``nan`` origin: first-NaN localisation across ranks and tensor families (see nanloc).

Tensor findings (msprobe CSV rows, anomaly dumps, alert lines: events with ``fields.via``)
define the origin when there are any; otherwise the earliest (step, rank) event is the origin,
as for every other kind. msprobe counts optimizer steps from 0 and frameworks their iterations
from 1, so text lines and tensor findings are never compared by step. The explanation goes to
the incident's ``detail``: ``root_cause``, ``notes`` and ``followed`` (which ranks and tensor
families were non-finite at which steps), returned with the origin for the incident's update
(``Origin.explains``): nothing here writes the incident.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._dc import dataclass
from ..detect.msprobe.names import looks_squashed
from ..store.events import Events, TensorGroup
from ..store.records import JSON, Incident
from .nanloc import GRADS, PHASE_RANK, Finding, first_param, localise, merge, ranks_of
from .origin import Origin, earliest_event_origin, origin_of, register


@dataclass(frozen=True)
class NanFinding:
    """What the tensor findings say about a NaN incident: its root cause, notes, and which
    ranks and tensor families were non-finite at which steps (``followed``)."""

    root_cause: str
    notes: tuple[str, ...]
    followed: tuple[Mapping[str, JSON], ...]

    def detail(self) -> dict[str, JSON]:
        """Its keys of the incident's ``detail`` (whatever else explains the incident, known
        causes, keeps its own)."""
        return {
            "root_cause": self.root_cause,
            "notes": list(self.notes),
            "followed": [dict(f) for f in self.followed],
        }


@register("nan")
def nan_origin(events: Events, inc: Incident) -> Origin:
    step = events.first_tensor_step(inc.id)
    if step is None:
        return earliest_event_origin(events, inc)
    at_step = merge(events.tensor_findings(inc.id, step))
    if not at_step:
        return earliest_event_origin(events, inc)
    story = localise(at_step, xy_monitored=events.activation_grads_monitored(inc.run_id, inc.id))
    fp = story.first_param or _later_first_param(events, inc.id, story.rank)
    origin = origin_of(story.root.ev)
    origin.update(
        phase=story.root.fields.get("phase"),
        tag=story.root.tag,
        tensor=story.root.tensor,
        module=story.module,
        first_param=_param_block(fp) if fp else None,
    )
    if story.root.micro is not None:
        origin["micro_step"] = story.root.micro
    if story.root.call_id is not None:
        origin["call_id"] = story.root.call_id
    cand_src = fp.fields if fp is not None and fp.fields.get("candidates") else story.root.fields
    if cand_src.get("candidates"):
        origin["candidates"] = list(cand_src["candidates"])
        origin["ambiguous"] = bool(cand_src.get("ambiguous"))
    notes = list(story.notes)
    notes += _empty_note(events, inc.run_id, story.rank, step)
    notes += _candidates_note(cand_src)
    named = fp.tensor if fp is not None else story.root.tensor
    if not cand_src.get("candidates") and looks_squashed(named):
        notes.append(
            f"{named} may be shortened by msprobe's squash_name (the default before 26.0): the "
            "module's full path then ends with it; `nanwatch shapes CHECKPOINT --shape ...` lists "
            "the parameters of that shape"
        )
    followed = _followed(events.tensor_groups(inc.id))
    notes += _followed_notes(followed)
    notes += _text_note(events, inc.id)
    finding = NanFinding(story.root_cause, tuple(notes), tuple(followed))
    return Origin(story.root.ev, origin, finding.detail())


def _param_block(fd: Finding) -> dict[str, JSON]:
    return {"tensor": fd.tensor, "tag": fd.tag, "shape": fd.fields.get("shape"), "step": fd.step}


def _later_first_param(events: Events, incident_id: int, rank: int | None) -> Finding | None:
    """No gradient went non-finite in the first step: the first one afterwards."""
    for tag in GRADS:
        rows = events.tensor_findings_tagged(incident_id, rank, tag, limit=2000)
        fds = [f for f in merge(rows) if f.role == "param"]
        if fds:
            first_step = min(f.step for f in fds)
            return first_param(sorted((f for f in fds if f.step == first_step), key=Finding.key))
    return None


# -- what followed, for `show` ---------------------------------------------------------------


def _followed(groups: list[TensorGroup]) -> list[dict[str, JSON]]:
    out: dict[tuple[int, str | None], dict[str, JSON]] = {}
    for g in groups:
        item = out.setdefault(
            (g.step, g.tag),
            {"step": g.step, "tag": g.tag, "ranks": [], "findings": 0, "sampled": False},
        )
        if g.rank is not None:
            item["ranks"].append(g.rank)
        item["findings"] += g.count
        item["sampled"] = item["sampled"] or g.sampled
    order = sorted(out.values(), key=lambda d: (d["step"], PHASE_RANK.get(d["tag"], 9)))
    return order[:400]


def _followed_notes(followed: list[dict[str, JSON]], shown: int = 4) -> list[str]:
    by_step: dict[int, list[str]] = {}
    for item in followed:
        who = ranks_of(item["ranks"]) if item["ranks"] else "an unknown rank"
        by_step.setdefault(item["step"], []).append(f"{item['tag']} on {who}")
    steps = sorted(by_step)
    lines = [f"step {s}: non-finite " + "; ".join(by_step[s]) for s in steps[:shown]]
    if len(steps) > shown:
        lines.append(
            f"... still non-finite at step {steps[-1]} ({len(steps) - shown} more steps seen; "
            "later steps are sampled)"
        )
    return lines


def _candidates_note(fields: Mapping[str, JSON]) -> list[str]:
    cands = fields.get("candidates")
    if not cands:
        return []
    total = fields.get("candidates_total", len(cands))
    shape = fields.get("shape")
    listed = ", ".join(f"`{c}`" for c in cands[:8]) + (" ..." if total > 8 else "")
    by = fields.get("candidates_by", "shape")
    if total > 1:
        return [
            f"{fields.get('tensor')} matches {total} parameters of the checkpoint by {by} "
            f"{shape}: ambiguous, one of {listed}"
        ]
    return [f"{fields.get('tensor')} is {listed} in the checkpoint (by {by} {shape})"]


def _empty_note(events: Events, run_id: int | None, rank: int | None, step: int) -> list[str]:
    """Empty tensors on the origin rank at the origin step: an empty input breaks some kernels."""
    rows = events.empty_tensors(run_id, rank, step)
    if not rows:
        return []
    what = ", ".join(f"{t} (shape {s})" for t, _, s in rows)
    mods = sorted({m for _, m, _ in rows if m})
    where = f" of `{'`, `'.join(mods)}`" if mods else ""
    return [
        f"empty tensors on rank {rank} at step {step}{where}: {what}; an empty input can make a "
        "module's backward produce NaN (e.g. an embedding on CANN before 8.0.0): look for samples "
        "without ground truth in that step's batch"
    ]


def _text_note(events: Events, incident_id: int) -> list[str]:
    ev = events.first_text_event(incident_id)
    if ev is None:
        return []
    return [
        f"the training log shows it too ({ev.message[:120]}); msprobe counts optimizer steps from "
        "0, the framework its iterations from 1: the tensor findings define the origin"
    ]
