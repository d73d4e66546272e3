"""The console sink: what `watch` and `demo` print when incidents open, change or resolve."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from ..render import origin_text, render_incident_line, render_story
from ..store.records import JSON, OutboxRow
from .outbox import Posted


def _cause(incident: Mapping[str, JSON]) -> str:
    """What a reader takes away as the root cause: where it started (a cause that only grows,
    other ranks timing out after it, is an update, not a correction)."""
    return origin_text(incident.get("origin") or {})


class ConsoleSink:
    name = "console"

    def __init__(self, stream: TextIO | None = None, *, color: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.color = self.stream.isatty() if color is None else color
        self._told: dict[int, str] = {}  # incident -> the root cause printed
        self._last: dict[int, str] = {}  # incident -> the last line printed for it

    def delay(self, action: str) -> float:
        return 0.0

    def deliver(
        self,
        row: OutboxRow,
        incident: Mapping[str, JSON],
        absorbed: Sequence[OutboxRow] = (),
    ) -> Posted | None:
        if not incident:
            return None
        iid = int(incident["id"])
        action = row.action
        cause = _cause(incident)
        told = self._told.get(iid)
        if action == "open" or (told is not None and cause != told and action != "resolve"):
            # a corrected root cause is told as fully as the first one: a one-line update
            # would leave the wrong story on the screen
            head = ""
            if action != "open":
                head = f"\n[corrected] #{iid}: the root cause changed (it was: {told})"
            text = render_story(incident, color=self.color, max_events=5)
            self.stream.write(f"{head}\n{text}\n")
            self._told[iid] = cause
            self._last.pop(iid, None)
        else:
            line = render_incident_line(incident, prefix=action)
            if self._last.get(iid) == line:
                return None  # nothing a reader could tell apart from the line above
            self.stream.write(line + "\n")
            self._last[iid] = line
        self.stream.flush()
        return None
