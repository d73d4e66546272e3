"""The rule packs' load cache: a start reads packs it checked before without parsing or
compiling them again; a changed pack is checked again, whatever the cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.errors import RuleError

PACK = """
[pack]
id = "site"

[[rule]]
id = "site.boom"
kind = "process_failure"
literals = ["BOOM"]
pattern = '''BOOM code=(?P<code>\\d+)'''
[[rule.example]]
line = "BOOM code=7"
event = { kind = "process_failure", fields = { code = "7" } }
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("NANWATCH_CACHE", str(d))
    return d


def _site(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "rules"
    d.mkdir(exist_ok=True)
    (d / "site.toml").write_text(text)
    return d


def test_a_second_load_compiles_nothing_until_used(cache: Path, tmp_path: Path) -> None:
    site = _site(tmp_path, PACK)
    first = load_rules([site])
    assert list(cache.glob("rules-*.marshal"))
    second = load_rules([site], check=False)  # the examples check would compile it
    assert [r.id for r in first.rules] == [r.id for r in second.rules]
    assert [r.groups for r in first.rules] == [r.groups for r in second.rules]
    boom = next(r for r in second.rules if r.id == "site.boom")
    assert boom.cre._obj is None  # not compiled at load
    det = Detector(second)
    events, _ = det.feed(b"BOOM code=7\n", 0, StreamState())
    assert [e.fields.get("code") for e in events] == ["7"]


def test_a_changed_pack_is_checked_again(cache: Path, tmp_path: Path) -> None:
    site = _site(tmp_path, PACK)
    load_rules([site])
    # nested unbounded quantifiers: refused at load, cache or not
    _site(tmp_path, PACK.replace("(?P<code>\\d+)", "(?P<code>(?:\\d+)*)"))
    with pytest.raises(RuleError, match=r"site\.boom"):
        load_rules([site])


def test_a_damaged_cache_is_read_as_empty(cache: Path, tmp_path: Path) -> None:
    site = _site(tmp_path, PACK)
    load_rules([site])
    for f in cache.glob("rules-*.marshal"):
        f.write_bytes(b"\x00not marshal")
    rs = load_rules([site])
    assert any(r.id == "site.boom" for r in rs.rules)
