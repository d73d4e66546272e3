"""Text for people: tables for `events`/`incidents`/`runs`, and the story `show` tells."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .events import ranks_text as ranks_text  # re-exported for the CLI and sinks
from .store.records import JSON

# what is rendered: the read side's JSON objects (nanwatch.query), as `--json` prints them
Doc = Mapping[str, JSON]

_BOLD = "\x1b[1m"
_RED = "\x1b[31m"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"


def _c(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_RESET}" if color else text


def table(rows: Sequence[Sequence[object]], headers: Sequence[str], *, max_width: int = 80) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, v in enumerate(row):
            widths[i] = min(max(widths[i], len(v)), max_width)

    def fmt(row: Sequence[str]) -> str:
        out = []
        for i, v in enumerate(row):
            if len(v) > widths[i]:
                v = v[: widths[i] - 1] + "…"
            out.append(v.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(list(headers)), fmt(["-" * w for w in widths])]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def where_text(o: Doc) -> str:
    bits = []
    if o.get("rank") is not None:
        bits.append(f"rank {o['rank']}")
    if o.get("step") is not None:
        bits.append(f"step {o['step']}")
    if o.get("epoch") is not None:
        bits.append(f"epoch {o['epoch']}")
    if o.get("iter") is not None:
        bits.append(f"iter {o['iter']}")
    if o.get("stage"):
        bits.append(f"stage {o['stage']}")
    return ", ".join(bits)


def origin_text(o: Doc) -> str:
    if not o:
        return "-"
    text = where_text(o)
    if o.get("tensor"):
        t = str(o["tensor"])
        if o.get("tag"):
            t += f" ({o['tag']})"
        if o.get("shape"):
            t += f" shape {o['shape']}"
        text += f"; {t}"
    if o.get("module"):
        text += f"; module {o['module']}"
    return text


def sample_text(d: Doc) -> str:
    """One sample finding: 'rank 6, epoch 3, iter 120: data/x.jpg (image_id 139)'."""
    where = where_text({k: d.get(k) for k in ("rank", "epoch", "iter")}) or "-"
    if d.get("reason") == "empty batch":
        return f"{where}: every sample of the batch has empty ground truth"
    what = str(d.get("image") or "a sample")
    if d.get("image_id") is not None:
        what += f" (image_id {d['image_id']})"
    return f"{where}: {what}"


def render_incident_line(inc: Doc, *, prefix: str | None = None) -> str:
    head = f"[{prefix}] " if prefix else ""
    return (
        f"{head}#{inc['id']} {inc['status']} {inc['kind']}: {inc['title']} "
        f"(ranks {ranks_text(inc.get('ranks', []))}, {inc.get('event_count', 0)} events)"
    )


def render_story(inc: Doc, *, color: bool = False, max_events: int = 10) -> str:
    """An incident as a short story: what, where, root cause, timeline, hints, next steps."""
    o = inc.get("origin") or {}
    lines = [
        _c(f"Incident #{inc['id']} [{inc['status']}] {inc['kind']}", _BOLD + _RED, color),
        f"  {inc['title']}",
        f"  run: {inc.get('run') or '-'}"
        + (f"   experiment: {inc['experiment']}" if inc.get("experiment") else "")
        + (f"   node: {inc['node']}" if inc.get("node") and len(inc.get("nodes") or []) < 2 else "")
        + (f"   nodes: {', '.join(inc['nodes'])}" if len(inc.get("nodes") or []) > 1 else ""),
        f"  ranks: {ranks_text(inc.get('ranks', []))}   events: {inc.get('event_count', 0)}   "
        f"first: {inc.get('first_time') or '-'}   last: {inc.get('last_time') or '-'}",
    ]
    if inc.get("job"):
        run = inc.get("cluster_run")
        lines.append(
            f"  job: {inc['job']}" + (f"   run: {run}" if run and run != inc["job"] else "")
        )
    if inc.get("acked_by"):
        lines.append(
            f"  Acknowledged by {inc['acked_by']} at {inc.get('acked_at') or '-'}"
            + (f": {inc['ack_note']}" if inc.get("ack_note") else "")
        )
    if inc.get("status") == "resolved":
        by = f" by {inc['resolved_by']}" if inc.get("resolved_by") else ""
        why = inc.get("resolve_note") if inc.get("resolved_by") else None
        why = why or (inc.get("detail") or {}).get("resolution")
        lines.append(
            _c(f"  Resolved{by} at {inc.get('resolved_at') or '-'}", _BOLD, color)
            + (f": {why}" if why else "")
        )
    detail = inc.get("detail") or {}
    if detail.get("root_cause"):
        lines.append(_c("  Root cause: ", _BOLD, color) + str(detail["root_cause"]))
    lines.append(_c("  Origin: ", _BOLD, color) + origin_text(o))
    fp = o.get("first_param")
    if fp:
        lines.append(
            f"  First parameter gradient non-finite: {fp.get('tensor')} ({fp.get('tag')}"
            + (f", shape {fp.get('shape')}" if fp.get("shape") else "")
            + ")"
        )
    for note in detail.get("notes", []):
        lines.append(f"  - {note}")
    related = detail.get("related_data_issues") or []
    if related:
        lines.append(_c("  Samples with empty ground truth just before it:", _BOLD, color))
        for d in related[:10]:
            lines.append(f"    {sample_text(d)}")
        if len(related) > 10:
            lines.append(f"    ... {len(related) - 10} more (nanwatch events --kind data_issue)")
    timeline = inc.get("timeline")
    if timeline:
        lines.append(_c("  Timeline:", _BOLD, color))
        multi = len({t.get("node") for t in timeline}) > 1
        for t in timeline[:20]:
            rank = "-" if t["rank"] is None else t["rank"]
            span = t["first_time"] or "-"
            steps = ""
            if t.get("first_step") is not None:
                steps = f" steps {t['first_step']}" + (
                    f"-{t['last_step']}" if t["last_step"] != t["first_step"] else ""
                )
            node = f"  {t['node']}" if multi and t.get("node") else ""
            lines.append(
                f"    rank {rank:>4}  {t['kind']:<15} x{t['count']:<5} from {span}{steps}{node}"
            )
        if len(timeline) > 20:
            lines.append(f"    ... {len(timeline) - 20} more")
    events = inc.get("events")
    if events:
        lines.append(_c("  Events:", _BOLD, color))
        for e in events[:max_events]:
            where = where_text(e)
            lines.append(
                f"    #{e['id']} {e.get('time') or '-'} {e['kind']} [{where}] {e['message'][:160]}"
            )
            if e.get("file"):
                lines.append(_c(f"        {e['file']}:{e.get('line') or '?'}", _DIM, color))
        if len(events) > max_events:
            lines.append(f"    ... {inc.get('event_count', len(events)) - max_events} more")
    hints = inc.get("hints") or []
    if hints:
        lines.append(_c("  Known causes:", _BOLD, color))
        for h in hints:
            lines.append(f"    * {h.get('title')}")
            for para in str(h.get("text", "")).strip().splitlines():
                lines.append(f"      {para}")
            for cmd in h.get("commands", []):
                lines.append(_c(f"      $ {cmd}", _DIM, color))
    lines.append(f"  More: nanwatch show {inc['id']}")
    return "\n".join(lines)
