"""The cache of the methods ``dataclasses`` generates: the same classes, compiled once."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nanwatch.cli._codecache import CodeCache

from ..conftest import ROOT


def _records() -> tuple[type[Any], type[Any]]:
    """A frozen slotted record and a plain one with defaults, built now."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class Frozen:
        name: str
        rank: int | None = None
        tags: tuple[str, ...] = ()

    @dataclasses.dataclass
    class Plain:
        n: int
        seen: list[int] = dataclasses.field(default_factory=list)
        note: str = dataclasses.field(default="", repr=False, compare=False)

    return Frozen, Plain


def _behaviour(build: Callable[[], tuple[type[Any], type[Any]]]) -> list[str]:
    """What the classes do, spelt out (classes built twice are different objects)."""
    frozen, plain = build()
    a, b = frozen("x", 3), frozen("x", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.rank = 4
    p = plain(1)
    p.seen.append(2)
    seen = [
        a == b,
        hash(a) == hash(b),
        repr(a),
        dataclasses.astuple(a),
        dataclasses.replace(a, rank=5),
        copy.deepcopy(a) == a,
        frozen.__match_args__,
        [f.name for f in dataclasses.fields(plain)],
        repr(p),
        p == plain(1, [2], note="other"),
        plain(2).seen is not plain(2).seen,
        frozen.__init__.__annotations__,
    ]
    return [repr(x) for x in seen]


def test_classes_built_from_the_cache_are_the_classes_built_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(dataclasses, "exec", raising=False)  # (a CLI test may have hooked it)
    without = _behaviour(_records)
    # a class of a module the cache does not keep: built as dataclasses builds it
    monkeypatch.setattr(dataclasses, "exec", CodeCache(tmp_path).exec, raising=False)
    assert _behaviour(_records) == without
    assert list(tmp_path.iterdir()) == []
    cache = CodeCache(tmp_path, modules=(__name__,))
    monkeypatch.setattr(dataclasses, "exec", cache.exec, raising=False)
    first = _behaviour(_records)
    assert cache.new > 0
    cache.save()
    assert [p.name for p in tmp_path.iterdir()] == [f"{__name__}.marshal"]
    again = CodeCache(tmp_path, modules=(__name__,))  # the next start
    monkeypatch.setattr(dataclasses, "exec", again.exec, raising=False)
    second = _behaviour(_records)
    assert again.new == 0  # nothing compiled: every method came from the file
    assert without == first == second


def test_only_the_named_modules_classes_and_no_file_others_could_write(tmp_path: Path) -> None:
    def compiled(cache: CodeCache, module: str) -> int:
        ns: dict[str, Any] = {}
        cache.exec("def f():\n return 1\n", {"__name__": module}, ns)
        assert ns["f"]() == 1
        return cache.new

    cache = CodeCache(tmp_path, modules=("nanwatch",))
    assert compiled(cache, "somebody.else") == 0  # compiled as dataclasses would, not kept
    assert compiled(cache, "nanwatch.store.records") == 1
    cache.save()
    path = tmp_path / "nanwatch.store.records.marshal"
    assert compiled(CodeCache(tmp_path), "nanwatch.store.records") == 0
    path.chmod(0o666)
    assert compiled(CodeCache(tmp_path), "nanwatch.store.records") == 1
    path.chmod(0o600)
    path.write_bytes(b"not marshal data")
    assert compiled(CodeCache(tmp_path), "nanwatch.store.records") == 1


def test_a_second_scan_compiles_no_generated_method(tmp_path: Path) -> None:
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
    env.update(PYTHONPATH=str(ROOT), NANWATCH_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "nanwatch", "scan", "--db", str(tmp_path / "nw.db"), str(empty)]

    def scan() -> dict[str, tuple[int, int]]:
        subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=tmp_path, timeout=120)
        found = (tmp_path / "cache").glob("dataclass-code-*/*.marshal")
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in found}

    first = scan()
    assert "nanwatch.store.records.marshal" in first and "nanwatch.config.marshal" in first
    assert scan() == first  # read the cache, wrote nothing: the same files
