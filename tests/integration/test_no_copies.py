"""The project's rules, examples and fixtures are written in real formats, never copied from the
labelled excerpts it is measured on (../shared/reallogs; skipped when absent).

A line with variable content (at least three digits: times, PIDs, sizes, sequence numbers) of
40 characters or more must not appear verbatim, white space aside, in any file of the project.
Fixed messages that every log of a framework prints are not samples, and may appear.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.test_reallogs import REALLOGS

ROOT = Path(__file__).resolve().parents[2]
_SPACE = re.compile(r"\s+")
_SKIP = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build"}


def _norm(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


def _samples() -> list[tuple[str, str]]:
    out = []
    for log in sorted(REALLOGS.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            n = _norm(line)
            if len(n) >= 40 and sum(c.isdigit() for c in n) >= 3:
                out.append((log.name, n))
    return out


def _project_files() -> list[Path]:
    files = []
    for p in ROOT.rglob("*"):
        if any(part in _SKIP or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts):
            continue
        if p.is_file() and p.suffix not in {".pyc", ".png", ".pth", ".so", ".db"}:
            files.append(p)
    return files


@pytest.mark.skipif(not (REALLOGS / "labels.jsonl").exists(), reason="no ../shared/reallogs")
def test_no_line_of_the_labelled_excerpts_is_copied_into_the_project() -> None:
    samples = _samples()
    assert len(samples) > 100  # the corpus is there and was read
    copies = []
    for f in _project_files():
        try:
            text = _norm(f.read_text(errors="replace"))
        except OSError:
            continue
        for name, line in samples:
            if line in text:
                copies.append(f"{f.relative_to(ROOT)}: a line of {name}: {line[:80]}")
    assert copies == []
