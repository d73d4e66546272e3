"""Builds the compiled chunk core (nanwatch/detect/_chunkcore.c) with the system C compiler.

Wheels get the extension beside the package's modules (and a platform tag); an editable
install gets it in the checkout, where the package is imported from. Without a compiler, or
when the build fails, the install goes on with a warning and nanwatch reads chunks in pure
Python (``nanwatch doctor`` says which). ``python hatch_build.py`` builds it in place by hand.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "nanwatch" / "detect" / "_chunkcore.c"
TARGET = "nanwatch/detect/_chunkcore" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def compile_core(out: Path) -> str | None:
    """Compile the extension to ``out``; None when it worked, else why not."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    cmd = [
        *cc,
        "-std=c99",
        "-O2",
        "-fPIC",
        "-shared",
        "-Wall",
        f"-I{include}",
        str(SOURCE),
        "-o",
        str(out),
    ]
    if sys.platform == "darwin":
        cmd[len(cc) : len(cc)] = ["-undefined", "dynamic_lookup"]
    try:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{shlex.join(cmd)}: {exc}"
    if got.returncode != 0 or not out.exists():
        return f"{shlex.join(cmd)} exited {got.returncode}: {got.stderr.strip()[-2000:]}"
    return None


def _warn(why: str) -> None:
    print(
        f"WARNING: nanwatch's compiled chunk core was not built ({why}); "
        "nanwatch will read logs in pure Python",
        file=sys.stderr,
    )


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run by hand, without hatchling
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """The wheel target's hook (``[tool.hatch.build.hooks.custom]`` in pyproject.toml)."""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or os.environ.get("NANWATCH_NO_CORE") == "1":
            return
        if version == "editable":
            # the checkout is what an editable install imports: the extension goes there
            why = compile_core(ROOT / TARGET)
            if why:
                _warn(why)
            return
        tmp = Path(tempfile.mkdtemp(prefix="nanwatch-core-"))
        out = tmp / Path(TARGET).name
        why = compile_core(out)
        if why:
            _warn(why)
            return
        build_data["force_include"][str(out)] = TARGET
        build_data["pure_python"] = False
        build_data["infer_tag"] = True


if __name__ == "__main__":
    why = compile_core(ROOT / TARGET)
    if why:
        print(why, file=sys.stderr)
        raise SystemExit(1)
    print(ROOT / TARGET)
