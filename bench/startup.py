"""How fast the CLI answers: `nanwatch --help`, `scan --help`, `watch --help` as processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .common import NANWATCH, median, timed

# the console script people type, when installed beside this interpreter
_SCRIPT = Path(sys.executable).parent / "nanwatch"


def run(runs: int) -> dict[str, Any]:
    cli = [str(_SCRIPT)] if _SCRIPT.exists() else NANWATCH
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "nanwatch --help": [*cli, "--help"],
        "nanwatch scan --help": [*cli, "scan", "--help"],
        "nanwatch watch --help": [*cli, "watch", "--help"],
    }
    out = {}
    for name, cmd in cases.items():
        timed(cmd)  # warm the page cache and the bytecode cache
        walls = [timed(cmd).wall for _ in range(runs)]
        out[name] = {"ms": round(1000 * median(walls), 1), "max_ms": round(1000 * max(walls), 1)}
    return out
