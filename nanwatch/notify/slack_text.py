"""What nanwatch says in Slack: the incident's parent message (Block Kit + plain-text fallback),
thread replies, and the escaping that keeps log text inert.

Everything that comes from a log, a run name or the knowledge base goes through :func:`escape`
(Slack's rule: ``&``, ``<`` and ``>`` become entities), so ``<!channel>``, ``<@U123>`` or
``<https://x|y>`` in a log line can neither ping anyone nor render as a link; mrkdwn objects
are ``verbatim`` so bare URLs and channel names are not linkified either. Long text is clipped
within Block Kit's limits and points to ``nanwatch show``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from ..render import origin_text, ranks_text
from ..store.records import JSON, OutboxRow

# Block Kit limits (docs: reference/block-kit/blocks)
HEADER_MAX = 150
SECTION_MAX = 3000
FIELD_MAX = 2000
FIELDS_MAX = 10
FALLBACK_MAX = 3000
CONTEXT_MAX = 2000

_PARTIAL_ENTITY = re.compile(r"&[a-z]{0,3}$")
_FENCE = "```"


def escape(text: object) -> str:
    """Slack's escaping for text that must be shown as is (mrkdwn and plain_text alike)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def clip(escaped: str, limit: int, more: str = "") -> str:
    """Cut already-escaped text to ``limit`` characters, never inside an entity."""
    if len(escaped) <= limit:
        return escaped
    keep = max(0, limit - len(more) - 1)
    cut = _PARTIAL_ENTITY.sub("", escaped[:keep])
    return cut + "…" + more


def _more(iid: JSON) -> str:
    return f" (truncated: nanwatch show {iid})"


def _code(text: str, limit: int, iid: JSON) -> str:
    # a backtick would end the code block early; its stand-in must not be a quote either: the
    # block may hold a suggested shell command, and a ' there would undo its quoting
    body = escape(text).replace("`", "\u02cb")
    return _FENCE + clip(body, limit - 2 * len(_FENCE), _more(iid)) + _FENCE


def _mrkdwn(text: str) -> dict[str, JSON]:
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def _section(text: str) -> dict[str, JSON]:
    return {"type": "section", "text": _mrkdwn(text)}


_ICONS = {"resolved": ":white_check_mark:", "merged": ":link:"}
_SOFT_BREAK = re.compile(r"(?<!\n)\n(?!\n)")
HINT_MAX = 700  # the full text is in `nanwatch show`


def status_icon(inc: Mapping[str, JSON]) -> str:
    return _ICONS.get(str(inc.get("status")), ":rotating_light:")


def _state(inc: Mapping[str, JSON]) -> str:
    """``Resolved: `` / ``Merged into #3: `` before the title; nothing while open."""
    status = inc.get("status")
    if status == "resolved":
        return "Resolved: "
    if status == "merged":
        into = (inc.get("detail") or {}).get("merged_into")
        return f"Merged into #{into}: " if into else "Merged: "
    return ""


def headline(inc: Mapping[str, JSON]) -> str:
    """One line, escaped: the fallback text and the notification preview."""
    iid = inc.get("id")
    state = _state(inc)
    title = str(inc.get("title", ""))
    run = inc.get("run")
    where = f"run {run}, " if run and f"(run {run})" not in title else ""
    text = (
        f"{status_icon(inc)} {state}#{iid} {escape(inc.get('kind', ''))}: {escape(title)} "
        f"({escape(where)}ranks {escape(ranks_text(inc.get('ranks') or []))}, "
        f"{inc.get('event_count', 0)} events). More: nanwatch show {iid}"
    )
    return clip(text, FALLBACK_MAX, _more(iid))


# The parent is read on a phone at 3 a.m.: what, where, why and the next command, in at most
# this many visible characters (header, sections and context together); the rest is the thread's.
PARENT_VISIBLE = 800
_SEVERITY_ICON = {"critical": ":red_circle:", "warning": ":large_orange_circle:"}
_RUN_SUFFIX = re.compile(r" \(run [^()]*\)$")


def visible_chars(blocks: Sequence[Mapping[str, JSON]]) -> int:
    """Characters a reader sees in Block Kit blocks (entities count as one)."""
    n = 0
    for b in blocks:
        texts = [b.get("text"), *(b.get("fields") or ()), *(b.get("elements") or ())]
        for t in texts:
            if isinstance(t, Mapping):
                body = str(t.get("text", ""))
                n += len(body) - 3 * body.count("&lt;") - 3 * body.count("&gt;")
                n -= 4 * body.count("&amp;")
    return n


def short_run(run: object, limit: int = 48) -> str:
    """A run name cut from the left at a path boundary: the launch is what tells runs apart."""
    text = str(run or "-")
    if len(text) <= limit:
        return text
    parts = text.split("/")
    while len(parts) > 1 and len("…/" + "/".join(parts)) > limit:
        parts.pop(0)
    tail = "/".join(parts)
    return "…/" + tail if len(tail) + 2 <= limit else "…" + tail[-(limit - 1) :]


def _root_cause(inc: Mapping[str, JSON]) -> str:
    """The root cause in a sentence: the correlator's, else one from the origin's fields."""
    detail = inc.get("detail") or {}
    if detail.get("root_cause"):
        return str(detail["root_cause"])
    o = inc.get("origin") or {}
    if inc.get("kind") == "slowdown" and o.get("baseline") and o.get("current"):
        against = f"the previous run {o['against']}" if o.get("against") else "its own first steps"
        return (
            f"step time {o['baseline']:.3g} s -> {o['current']:.3g} s "
            f"({o.get('ratio') or o['current'] / o['baseline']:.3g}x) against {against}"
        )
    return origin_text(o)


def _next_commands(inc: Mapping[str, JSON], limit: int = 2) -> list[str]:
    """The first command of each of the first known causes (the thread has them all)."""
    out: list[str] = []
    for h in inc.get("hints") or []:
        commands = [str(c) for c in h.get("commands") or []]
        if commands and commands[0] not in out:
            out.append(commands[0])
        if len(out) >= limit:
            break
    return out


def _show_command(inc: Mapping[str, JSON]) -> str:
    cmd = f"nanwatch show {inc.get('id')}"
    if inc.get("_config"):
        cmd += f" --config {inc['_config']}"
    return cmd


def _people(inc: Mapping[str, JSON]) -> str:
    """Who acknowledged or resolved it, and when (`nanwatch ack` / `nanwatch resolve`)."""
    if inc.get("resolved_by"):
        return f"resolved by {inc['resolved_by']} at {inc.get('resolved_at') or '-'}"
    if inc.get("acked_by"):
        return f"acknowledged by {inc['acked_by']} at {inc.get('acked_at') or '-'}"
    return ""


def parent_blocks(
    inc: Mapping[str, JSON], *, first_line: str | None = None
) -> list[dict[str, JSON]]:
    """The incident's parent message: what, where, root cause and the next command.

    At most :data:`PARENT_VISIBLE` visible characters; the origin in full, the first line of the
    log and every known cause go to the thread (:func:`details_text`). ``first_line`` is kept
    for callers of the older signature and shown only as the log's ``file:line``.
    """
    del first_line  # the line itself is the thread's
    iid = inc.get("id")
    title = _RUN_SUFFIX.sub("", str(inc.get("title", "")))
    severity = str(inc.get("severity") or "")
    icon = _ICONS.get(str(inc.get("status"))) or _SEVERITY_ICON.get(severity, ":rotating_light:")
    head = f"{_state(inc)}#{iid} {title}"
    blocks: list[dict[str, JSON]] = [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": clip(escape(head), 110), "emoji": False},
        }
    ]
    o = inc.get("origin") or {}
    where = [f"run `{escape(short_run(inc.get('run')))}`"]
    if inc.get("node"):
        where.append(f"host `{clip(escape(inc['node']), 40)}`")
    if o.get("rank") is not None:
        where.append(f"rank {escape(o['rank'])}")
    if inc.get("_root_where"):
        where.append(f"`{clip(escape(inc['_root_where']), 60)}`")
    what = f"{icon} *{escape(inc.get('kind', ''))}*"
    if severity:
        what += f" · {escape(severity)}"
    ack = inc.get("_ack") or _people(inc)
    if ack:
        what += " · " + clip(escape(ack), 90)
    lines = [what + " · " + " · ".join(where)]
    lines.append("*Root cause:* " + clip(escape(_root_cause(inc)), 260))
    budget = 720 - visible_chars(blocks) - sum(len(x) for x in lines)
    for cmd in _next_commands(inc):
        # a backtick would end the code span; a quote would change what the pasted command does
        body = escape(cmd).replace("`", "\u02cb")
        room = min(200, budget - 12)
        if room < 40:
            break
        line = f"*Next:* `{clip(body, room)}`"
        lines.append(line)
        budget -= len(line)
    blocks.append(_section("\n".join(lines)))
    seen = inc.get("first_time") or "-"
    ranks = clip(escape(ranks_text(inc.get("ranks") or [])), 40)
    footer = (
        f"`{escape(_show_command(inc))}` · {inc.get('event_count', 0)} events · ranks {ranks}"
        f" · since {escape(seen)}"
    )
    if inc.get("updated_at"):
        footer += f" · updated {escape(inc['updated_at'])}"
    room = PARENT_VISIBLE - visible_chars(blocks)
    blocks.append({"type": "context", "elements": [_mrkdwn(clip(footer, max(40, room), ""))]})
    return blocks


def details_text(inc: Mapping[str, JSON], *, first_line: str | None = None) -> str:
    """The thread's first reply: the origin in full, the log's first line, every known cause."""
    iid = inc.get("id")
    more = _more(iid)
    o = inc.get("origin") or {}
    parts = ["*Origin:* " + clip(escape(origin_text(o)), 600, more)]
    fp = o.get("first_param")
    if fp:
        parts.append(
            "*First parameter gradient non-finite:* "
            + escape(f"{fp.get('tensor')} ({fp.get('tag')}, shape {fp.get('shape')})")
        )
    if first_line:
        where = f" ({escape(inc['_root_where'])})" if inc.get("_root_where") else ""
        parts.append(f"*First sign in the log{where}:*\n" + _code(first_line, 900, iid))
    for h in inc.get("hints") or []:
        text = f"*Known cause:* {escape(h.get('title', ''))}"
        body = _SOFT_BREAK.sub(" ", str(h.get("text") or "").strip())
        if body:
            text += "\n" + clip(escape(body), HINT_MAX, more)
        for c in [str(c) for c in h.get("commands") or []][:3]:
            text += "\n" + _code(c, 400, iid)
        parts.append(text)
    parts.append(f"_Everything: `{escape(_show_command(inc))}`_")
    return clip("\n\n".join(parts), SECTION_MAX, more)


def merged_news(rows: Iterable[OutboxRow]) -> list[str]:
    """The news strings of several outbox rows, in order, without repeats."""
    seen: dict[str, None] = {}
    for row in rows:
        for item in (row.payload or {}).get("news") or []:
            seen.setdefault(str(item), None)
    return list(seen)


def follow_up(
    inc: Mapping[str, JSON], news: Sequence[str], actions: set[str], *, standalone: bool = False
) -> str | None:
    """A thread reply (or, for webhooks, a short post) with what is new; None if nothing is."""
    iid = inc.get("id")
    lines = []
    if standalone:
        lines.append(f"*#{iid} {escape(inc.get('title', ''))}*")
    for item in news:
        lines.append("• " + escape(item))
    if "resolve" in actions or (inc.get("status") == "resolved" and news):
        when = f" at {escape(inc['resolved_at'])}" if inc.get("resolved_at") else ""
        lines.append(f":white_check_mark: Resolved{when}.")
    elif "remind" in actions and not news:
        lines.append(
            f":alarm_clock: Still open: {inc.get('event_count', 0)} events on ranks "
            f"{escape(ranks_text(inc.get('ranks') or []))}, last seen "
            f"{escape(inc.get('last_time') or '-')}."
        )
    if len(lines) <= (1 if standalone else 0):
        return None
    lines.append(
        f"_now {inc.get('event_count', 0)} events, ranks "
        f"{escape(ranks_text(inc.get('ranks') or []))}; nanwatch show {iid}_"
    )
    return clip("\n".join(lines), SECTION_MAX, _more(iid))


def test_message(where: str) -> tuple[str, list[dict[str, JSON]]]:
    text = f":wave: nanwatch test message for {escape(where)}: notifications work."
    return text, [_section(text)]
