"""The README's "How the code is laid out" names what `ls nanwatch/` holds, no more, no less."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_layout_section_matches_the_package() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### How the code is laid out", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    named = set()
    for line in table:
        first_cell = line.split("|")[1]
        named |= {n.rstrip("/").removesuffix(".py") for n in re.findall(r"`([^`]+)`", first_cell)}
    present = {
        p.name.removesuffix(".py")
        for p in (ROOT / "nanwatch").iterdir()
        if not p.name.startswith("__") and p.name != "_data" and (p.suffix == ".py" or p.is_dir())
    }
    assert named == present


def test_the_top_level_holds_only_stages_the_read_side_and_vocabulary() -> None:
    allowed = {
        "sources", "detect", "store", "correlate", "notify", "daemon", "cli", "demo",
        "integrations", "query", "render", "probe", "events", "errors", "config", "stream", "_dc",
    }  # fmt: skip
    present = {
        p.name.removesuffix(".py")
        for p in (ROOT / "nanwatch").iterdir()
        if not p.name.startswith("__") and p.name != "_data" and (p.suffix == ".py" or p.is_dir())
    }
    assert present <= allowed, present - allowed


def test_only_the_store_speaks_sql() -> None:
    """No SQL statement, no connection and no database driver outside nanwatch/store/."""
    sql = re.compile(r"\b(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE TABLE)\b")
    conn = re.compile(r"\._?conn\b|^\s*(import sqlite3|from sqlite3|import psycopg|from psycopg)")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in sorted((ROOT / "nanwatch").rglob("*.py"))
        if "store" not in p.relative_to(ROOT / "nanwatch").parts[:1]
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if sql.search(line) or conn.search(line)
    ]
    assert offenders == []
