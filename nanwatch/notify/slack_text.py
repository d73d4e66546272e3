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
from typing import Any

from ..render import origin_text, ranks_text

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


def _more(iid: Any) -> str:
    return f" (truncated: nanwatch show {iid})"


def _code(text: str, limit: int, iid: Any) -> str:
    # backticks in a log line would end the code block early
    body = escape(text).replace("`", "'")
    return _FENCE + clip(body, limit - 2 * len(_FENCE), _more(iid)) + _FENCE


def _mrkdwn(text: str) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": text, "verbatim": True}


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": _mrkdwn(text)}


_ICONS = {"resolved": ":white_check_mark:", "merged": ":link:"}
_SOFT_BREAK = re.compile(r"(?<!\n)\n(?!\n)")
HINT_MAX = 700  # the full text is in `nanwatch show`


def status_icon(inc: Mapping[str, Any]) -> str:
    return _ICONS.get(str(inc.get("status")), ":rotating_light:")


def _state(inc: Mapping[str, Any]) -> str:
    """``Resolved: `` / ``Merged into #3: `` before the title; nothing while open."""
    status = inc.get("status")
    if status == "resolved":
        return "Resolved: "
    if status == "merged":
        into = (inc.get("detail") or {}).get("merged_into")
        return f"Merged into #{into}: " if into else "Merged: "
    return ""


def headline(inc: Mapping[str, Any]) -> str:
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


def parent_blocks(inc: Mapping[str, Any], *, first_line: str | None = None) -> list[dict[str, Any]]:
    """The incident's parent message: what, where, root cause and origin, top hint, more."""
    iid = inc.get("id")
    more = _more(iid)
    head = _state(inc) + f"#{iid} {inc.get('title', '')}"
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": clip(escape(head), HEADER_MAX), "emoji": False},
        }
    ]
    fields = [
        ("Status", f"{status_icon(inc)} {inc.get('status', 'open')} ({inc.get('kind', '')})"),
        ("Run", inc.get("run") or "-"),
        ("Host", inc.get("node") or "-"),
        ("Ranks", ranks_text(inc.get("ranks") or [])),
        ("Events", str(inc.get("event_count", 0))),
        ("Seen", f"{inc.get('first_time') or '-'} .. {inc.get('last_time') or '-'}"),
    ]
    blocks.append(
        {
            "type": "section",
            "fields": [
                _mrkdwn(f"*{name}*\n" + clip(escape(value), FIELD_MAX - len(name) - 3, more))
                for name, value in fields[:FIELDS_MAX]
            ],
        }
    )
    detail = inc.get("detail") or {}
    origin = inc.get("origin") or {}
    cause = []
    if detail.get("root_cause"):
        cause.append("*Root cause:* " + escape(detail["root_cause"]))
    cause.append("*Origin:* " + escape(origin_text(origin)))
    fp = origin.get("first_param")
    if fp:
        cause.append(
            "*First parameter gradient non-finite:* "
            + escape(f"{fp.get('tensor')} ({fp.get('tag')}, shape {fp.get('shape')})")
        )
    blocks.append(_section(clip("\n".join(cause), SECTION_MAX, more)))
    if first_line:
        label = "*First sign in the log:*\n"
        blocks.append(_section(label + _code(first_line, SECTION_MAX - len(label), iid)))
    hints = inc.get("hints") or []
    if hints:
        h = hints[0]
        text = f"*Known cause:* {escape(h.get('title', ''))}"
        # knowledge-base text is wrapped for terminals; Slack wraps by itself
        body = _SOFT_BREAK.sub(" ", str(h.get("text") or "").strip())
        if body:
            text += "\n" + clip(escape(body), HINT_MAX, more)
        commands = [str(c) for c in h.get("commands") or []]
        if commands:
            text += "\n" + _code(commands[0], SECTION_MAX - len(text) - 1, iid)
        if len(hints) > 1:
            text += f"\n_{len(hints) - 1} more known cause(s): nanwatch show {iid}_"
        blocks.append(_section(clip(text, SECTION_MAX, more)))
    footer = f"More: `nanwatch show {iid}`"
    if inc.get("acked_by"):
        footer += f"  ·  acknowledged by {escape(inc['acked_by'])} at {escape(inc.get('acked_at'))}"
    if inc.get("resolved_by"):
        footer += (
            f"  ·  resolved by {escape(inc['resolved_by'])} at {escape(inc.get('resolved_at'))}"
        )
    if inc.get("updated_at"):
        footer += f"  ·  updated {escape(inc['updated_at'])}"
    blocks.append({"type": "context", "elements": [_mrkdwn(clip(footer, CONTEXT_MAX))]})
    return blocks


def merged_news(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The news strings of several outbox rows, in order, without repeats."""
    seen: dict[str, None] = {}
    for row in rows:
        for item in (row.get("payload") or {}).get("news") or []:
            seen.setdefault(str(item), None)
    return list(seen)


def follow_up(
    inc: Mapping[str, Any], news: Sequence[str], actions: set[str], *, standalone: bool = False
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


def test_message(where: str) -> tuple[str, list[dict[str, Any]]]:
    text = f":wave: nanwatch test message for {escape(where)}: notifications work."
    return text, [_section(text)]
