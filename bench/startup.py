"""How fast the CLI answers: `nanwatch --help`, `scan --help`, `watch --help` as processes."""

from __future__ import annotations

import shutil
import sys
import tempfile
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
    # a scan of an empty file: imports, the rule packs (from their load cache) and the database
    tmp = Path(tempfile.mkdtemp(prefix="nanwatch-bench-startup-"))
    empty = tmp / "empty.log"
    empty.write_bytes(b"")
    cases["nanwatch scan (an empty file)"] = [
        *NANWATCH,  # this checkout's code, whatever is installed
        "scan",
        "--json",
        "--db",
        str(tmp / "db.sqlite"),
        str(empty),
    ]
    out = {}
    try:
        for name, cmd in cases.items():
            timed(cmd)  # warm the page cache and the bytecode cache
            walls = [timed(cmd).wall for _ in range(runs)]
            out[name] = {
                "ms": round(1000 * median(walls), 1),
                "max_ms": round(1000 * max(walls), 1),
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
