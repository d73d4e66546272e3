"""The console sink: what `watch` and `demo` print when incidents open, change or resolve."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

from ..render import render_incident_line, render_story


class ConsoleSink:
    name = "console"

    def __init__(self, stream: TextIO | None = None, *, color: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.color = self.stream.isatty() if color is None else color

    def delay(self, action: str) -> float:
        return 0.0

    def deliver(
        self, row: Mapping[str, Any], incident: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        if not incident:
            return None
        action = row["action"]
        if action == "open":
            text = render_story(incident, color=self.color, max_events=5)
            self.stream.write(f"\n{text}\n")
        else:
            self.stream.write(render_incident_line(incident, prefix=action) + "\n")
        self.stream.flush()
        return None
