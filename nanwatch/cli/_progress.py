"""Progress bars for long CLI work (`scan`, `check-dataset`, `merge`): on stderr, on a
terminal only, never with --json."""

from __future__ import annotations

import glob
import os
import sys
import time
from typing import Any

import click


class Progress:
    """A progress bar on stderr for long work (bytes, files, rate, ETA), only on a terminal
    and never with --json; otherwise every call does nothing."""

    def __init__(self, total: int, label: str, *, enabled: bool, unit: str = "files") -> None:
        self.total = max(total, 1)
        self.done = 0
        self.count = 0
        self.unit = unit
        self.started = time.monotonic()
        self._bar: Any = None
        if enabled and _stderr_is_tty():
            self._bar = click.progressbar(
                length=self.total,
                label=label,
                file=sys.stderr,
                show_eta=True,
                show_percent=True,
                item_show_func=lambda info: info,
            )
            self._bar.__enter__()

    def update(self, done: int, count: int | None = None) -> None:
        """``done`` bytes so far (and ``count`` files, databases, ...)."""
        if self._bar is None:
            return
        step = max(0, min(done, self.total) - self.done)
        self.done += step
        if count is not None:
            self.count = count
        rate = self.done / max(time.monotonic() - self.started, 1e-6)
        info = (
            f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, {self.count} {self.unit}, "
            f"{rate / 1e6:.1f} MB/s"
        )
        self._bar.update(step, current_item=info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None


def _stderr_is_tty() -> bool:
    try:
        return bool(sys.stderr.isatty())
    except (ValueError, AttributeError):
        return False


def tree_size(paths: list[str]) -> tuple[int, int]:
    """Bytes and files below ``paths`` (files, folders, globs): what a scan will read at most."""
    total = files = 0
    for p in paths:
        for match in glob.glob(p, recursive=True) or [p]:
            if os.path.isfile(match):
                walk: Any = [(os.path.dirname(match), [], [os.path.basename(match)])]
            else:
                walk = os.walk(match)
            for d, _, names in walk:
                for n in names:
                    try:
                        total += os.path.getsize(os.path.join(d, n))
                        files += 1
                    except OSError:
                        continue
    return total, files
