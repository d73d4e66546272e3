"""The ``nan`` origin: first-NaN localisation across ranks and tensor families (see nanloc).

Tensor findings (msprobe CSV rows, anomaly dumps, alert lines: events with ``fields.via``)
define the origin when there are any; otherwise the earliest (step, rank) event is the origin,
as for every other kind. msprobe counts optimizer steps from 0 and frameworks their iterations
from 1, so text lines and tensor findings are never compared by step. The explanation goes to
the incident's ``detail``: ``root_cause``, ``notes`` and ``followed`` (which ranks and tensor
families were non-finite at which steps).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from ..detect.msprobe.names import looks_squashed
from ..store.db import Store
from ..store.records import EVENT_COLUMNS
from .nanloc import GRADS, PHASE_RANK, Finding, first_param, localise, merge, ranks_of
from .origin import earliest_event_origin, origin_of, register

_TENSOR = 'fields LIKE \'%"via":"%\''


def _events(conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
    return [Store._event(r) for r in conn.execute(sql, params).fetchall()]


@register("nan")
def nan_origin(
    conn: sqlite3.Connection, incident_id: int
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    row = conn.execute(
        f"SELECT min(step) FROM events WHERE incident_id=? AND step IS NOT NULL AND {_TENSOR}",
        (incident_id,),
    ).fetchone()
    if row is None or row[0] is None:
        return earliest_event_origin(conn, incident_id)
    step = int(row[0])
    at_step = merge(
        _events(
            conn,
            f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id=? AND step=? AND {_TENSOR}",
            (incident_id, step),
        )
    )
    if not at_step:
        return earliest_event_origin(conn, incident_id)
    story = localise(at_step, xy_monitored=_xy_monitored(conn, incident_id))
    fp = story.first_param or _later_first_param(conn, incident_id, story.rank)
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
    notes += _empty_note(conn, incident_id, story.rank, step)
    notes += _candidates_note(cand_src)
    named = fp.tensor if fp is not None else story.root.tensor
    if not cand_src.get("candidates") and looks_squashed(named):
        notes.append(
            f"{named} may be shortened by msprobe's squash_name (the default before 26.0): the "
            "module's full path then ends with it; `nanwatch shapes CHECKPOINT --shape ...` lists "
            "the parameters of that shape"
        )
    followed = _followed(conn, incident_id)
    notes += _followed_notes(followed)
    notes += _text_note(conn, incident_id)
    _write_detail(conn, incident_id, story.root_cause, notes, followed)
    return story.root.ev, origin


def _xy_monitored(conn: sqlite3.Connection, incident_id: int) -> bool:
    """Did the run record activation gradients (msprobe's xy_distribution)?"""
    row = conn.execute(
        "SELECT 1 FROM sources WHERE run_id = (SELECT run_id FROM incidents WHERE id=?) AND "
        "(path LIKE '%/actv\\_grad\\_%' ESCAPE '\\' OR path LIKE '%/module\\_step%' ESCAPE '\\') "
        "LIMIT 1",
        (incident_id,),
    ).fetchone()
    if row is not None:
        return True
    row = conn.execute(
        f"SELECT 1 FROM events WHERE incident_id=? AND {_TENSOR} AND fields LIKE "
        '\'%"tag":"actv_grad"%\' LIMIT 1',
        (incident_id,),
    ).fetchone()
    return row is not None


def _param_block(fd: Finding) -> dict[str, Any]:
    return {"tensor": fd.tensor, "tag": fd.tag, "shape": fd.fields.get("shape"), "step": fd.step}


def _later_first_param(
    conn: sqlite3.Connection, incident_id: int, rank: int | None
) -> Finding | None:
    """No gradient went non-finite in the first step: the first one afterwards."""
    for tag in GRADS:
        like = f'%"tag":"{tag}"%'
        rows = _events(
            conn,
            f"SELECT {EVENT_COLUMNS} FROM events WHERE incident_id=? AND rank IS ? AND "
            f"fields LIKE ? AND {_TENSOR} ORDER BY step, id LIMIT 2000",
            (incident_id, rank, like),
        )
        fds = [f for f in merge(rows) if f.role == "param"]
        if fds:
            first_step = min(f.step for f in fds)
            return first_param(sorted((f for f in fds if f.step == first_step), key=Finding.key))
    return None


# -- what followed, for `show` ---------------------------------------------------------------


def _followed(conn: sqlite3.Connection, incident_id: int) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT step, json_extract(fields, '$.tag') AS tag, rank, count(*), "
        "max(coalesce(json_extract(fields, '$.sampled'), 0)) FROM events "
        f"WHERE incident_id=? AND step IS NOT NULL AND {_TENSOR} "
        "GROUP BY step, tag, rank ORDER BY step, tag, rank",
        (incident_id,),
    ).fetchall()
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for step, tag, rank, n, sampled in rows:
        item = out.setdefault(
            (step, tag), {"step": step, "tag": tag, "ranks": [], "findings": 0, "sampled": False}
        )
        if rank is not None:
            item["ranks"].append(rank)
        item["findings"] += n
        item["sampled"] = item["sampled"] or bool(sampled)
    order = sorted(out.values(), key=lambda d: (d["step"], PHASE_RANK.get(d["tag"], 9)))
    return order[:400]


def _followed_notes(followed: list[dict[str, Any]], shown: int = 4) -> list[str]:
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


def _candidates_note(fields: Mapping[str, Any]) -> list[str]:
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


def _empty_note(
    conn: sqlite3.Connection, incident_id: int, rank: int | None, step: int
) -> list[str]:
    """Empty tensors on the origin rank at the origin step: an empty input breaks some kernels."""
    rows = conn.execute(
        "SELECT DISTINCT json_extract(fields, '$.tensor'), json_extract(fields, '$.module'), "
        "json_extract(fields, '$.shape') FROM events WHERE kind='data_issue' AND run_id = "
        "(SELECT run_id FROM incidents WHERE id=?) AND rank IS ? AND step=? AND "
        'fields LIKE \'%"reason":"empty tensor"%\' LIMIT 5',
        (incident_id, rank, step),
    ).fetchall()
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


def _text_note(conn: sqlite3.Connection, incident_id: int) -> list[str]:
    row = conn.execute(
        "SELECT message, iter, epoch, rank FROM events WHERE incident_id=? AND NOT "
        f"({_TENSOR}) ORDER BY step IS NULL, step, id LIMIT 1",
        (incident_id,),
    ).fetchone()
    if row is None:
        return []
    return [
        f"the training log shows it too ({row[0][:120]}); msprobe counts optimizer steps from "
        "0, the framework its iterations from 1: the tensor findings define the origin"
    ]


def _write_detail(
    conn: sqlite3.Connection,
    incident_id: int,
    root_cause: str,
    notes: list[str],
    followed: list[dict[str, Any]],
) -> None:
    # only these keys: whatever else explains the incident (known causes) keeps its own
    conn.execute(
        "UPDATE incidents SET detail = json_set(coalesce(nullif(detail, ''), '{}'), "
        "'$.root_cause', ?, '$.notes', json(?), '$.followed', json(?)) WHERE id=?",
        (root_cause, json.dumps(notes), json.dumps(followed), incident_id),
    )
