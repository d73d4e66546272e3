"""The rule packs' load cache: a start reads packs it checked before without parsing or
compiling them again; a changed pack is checked again, whatever the cache holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _fields(rs: object) -> list[dict[str, object]]:
    """Every rule and prefix as its fields, the compiled patterns left out."""
    import dataclasses

    out = []
    for item in [*rs.prefixes, *rs.rules]:  # type: ignore[attr-defined]
        d = dataclasses.asdict(item)
        d.pop("cre")
        d.pop("chunk_cre", None)
        d["chunk"] = getattr(item, "chunk", None)
        out.append(d)
    return out


def test_a_load_from_the_cache_gives_the_rules_a_check_gives(cache: Path, tmp_path: Path) -> None:
    site = _site(tmp_path, PACK)
    checked = load_rules([site])
    cached = load_rules([site], check=False)  # the examples check would compile them
    assert all(r.cre._obj is None for r in cached.rules)  # from the cache indeed
    assert _fields(cached) == _fields(checked)
    assert cached.packs == checked.packs


def test_a_cache_hit_neither_parses_nor_checks_a_pack(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanwatch.detect import rules

    site = _site(tmp_path, PACK)
    load_rules([site])

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a pack the cache knows was checked again")

    monkeypatch.setattr(rules, "_load_pack", refuse)
    monkeypatch.setattr("tomllib.loads", refuse)
    rs = load_rules([site], check=False)
    assert any(r.id == "site.boom" for r in rs.rules)


def test_an_id_taken_by_another_pack_is_refused_from_the_cache_too(
    cache: Path, tmp_path: Path
) -> None:
    site = _site(tmp_path, PACK)
    load_rules([site])
    # a second pack, new to the cache, takes the id the cached one holds
    (site / "a_other.toml").write_text(PACK.replace('id = "site"', 'id = "other"'))
    with pytest.raises(RuleError, match=r"duplicate id"):
        load_rules([site])


def _count_restores(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from nanwatch.detect import rules

    restored: list[str] = []
    real = rules._restore_pack

    def counting(src: Path, *args: Any) -> None:
        restored.append(src.name)
        real(src, *args)

    monkeypatch.setattr(rules, "_restore_pack", counting)
    return restored


def test_the_same_packs_again_build_no_rule_until_one_is_looked_at(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanwatch.detect.rules import RuleSet

    site = _site(tmp_path, PACK)
    first = load_rules([site], check=False)
    ids = [r.id for r in first.rules]
    restored = _count_restores(monkeypatch)
    again = load_rules([site], check=False)
    assert isinstance(again, RuleSet)
    assert restored == []  # nothing unmarshalled, nothing built
    assert [r.id for r in again.rules] == ids
    assert restored and restored[0] == "site.toml"  # every pack, once
    n = len(restored)
    assert again.by_id("site.boom") is not None and len(restored) == n


def test_a_scan_that_reads_no_text_builds_no_rule(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nanwatch.config import Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.store import Store

    empty = tmp_path / "empty"
    empty.mkdir()
    log = tmp_path / "logs" / "rank0.log"
    log.parent.mkdir()
    log.write_text("BOOM code=7\n")
    load_rules()  # a first start: every shipped pack checked and kept
    restored = _count_restores(monkeypatch)
    store = Store.open(tmp_path / "nw.db")
    try:
        Pipeline(Config(), store, [str(empty)]).scan()
        assert restored == []
        Pipeline(Config(), store, [str(log.parent)]).scan()
        assert restored  # a text file: the rules were built for it
    finally:
        store.close()
