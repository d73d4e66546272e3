"""The literal prefilter: every occurrence of a set of literals in a chunk, in one pass.

Intel Hyperscan (the ``hyperscan`` package, ``nanwatch[speed]``) when it is installed: its
database is compiled once per literal set and kept on disk (a serialized database keyed by the
literals' hash), so a start reads it back in milliseconds. Otherwise an Aho-Corasick DFA
(``ahocorasick_rs``); without either, a regex alternation. Every backend gives the same
occurrences, overlapping ones included, sorted by position.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("nanwatch.detect")

Found = list[tuple[int, int, int]]  # (literal index, start, end)


def cache_dir() -> Path:
    """Where compiled prefilter databases are kept: ``$NANWATCH_CACHE``, else the XDG cache."""
    env = os.environ.get("NANWATCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nanwatch"


def backend_name() -> str:
    """The backend a new prefilter uses here (``nanwatch doctor`` prints it)."""
    if _hyperscan() is not None:
        return "hyperscan"
    try:
        import ahocorasick_rs  # noqa: F401
    except ImportError:  # pragma: no cover - a platform without the wheel
        return "regex"
    return "ahocorasick"


def _hyperscan() -> Any:
    if os.environ.get("NANWATCH_NO_HYPERSCAN"):
        return None
    try:
        import hyperscan
    except ImportError:
        return None
    return hyperscan


class Prefilter:
    """Occurrences of ``literals`` (bytes) in a chunk; ``backend``: None for the best one here,
    else ``hyperscan``, ``ahocorasick`` or ``regex``."""

    def __init__(self, literals: Sequence[bytes], backend: str | None = None) -> None:
        self.literals = list(literals)
        self.backend = backend or backend_name()
        self._db: Any = None
        self._scratch: Any = None
        self._ac: Any = None
        self._re: Any = None
        self._index: dict[bytes, int] = {}
        self._lens = [len(lit) for lit in self.literals]
        if not self.literals:
            self.backend = "none"
        elif self.backend == "hyperscan":
            self._db = _hs_database(self.literals)
            if self._db is None:
                self.backend = "ahocorasick"
        if self.backend == "ahocorasick":
            try:
                import ahocorasick_rs

                # a DFA: ~1.5x the default NFA's speed on log text, for ~1 MB of tables
                self._ac = ahocorasick_rs.BytesAhoCorasick(
                    self.literals, implementation=ahocorasick_rs.Implementation.DFA
                )
            except ImportError:  # pragma: no cover - a platform without the wheel
                self.backend = "regex"
        if self.backend == "regex":
            by_len = sorted(self.literals, key=len, reverse=True)
            self._re = re.compile(b"|".join(re.escape(lit) for lit in by_len))
            self._index = {lit: i for i, lit in enumerate(self.literals)}

    def find(self, chunk: bytes) -> Found:
        """(literal index, start, end) of every occurrence, sorted by start then index."""
        if self.backend == "none" or not chunk:
            return []
        if self._db is not None:
            found: Found = []
            lens = self._lens
            add = found.append

            def on_match(idx: int, _from: int, to: int, _flags: int, _ctx: Any) -> None:
                add((idx, to - lens[idx], to))

            self._db.scan(chunk, match_event_handler=on_match, scratch=self._scratch)
            found.sort(key=_start_then_index)
            return found
        if self._ac is not None:
            got: Found = self._ac.find_matches_as_indexes(chunk, overlapping=True)
            got.sort(key=_start_then_index)
            return got
        found = []
        pos = 0
        while True:
            # overlapping occurrences are found by restarting one byte after each hit
            m = self._re.search(chunk, pos)
            if m is None:
                break
            s = m.start()
            for lit, i in self._index.items():
                if chunk.startswith(lit, s):
                    found.append((i, s, s + len(lit)))
            pos = s + 1
        found.sort(key=_start_then_index)
        return found

    def __getstate__(self) -> dict[str, Any]:
        # worker processes are forked: the database travels as bytes if ever pickled
        state = dict(self.__dict__)
        state["_db"] = state["_scratch"] = None
        state["_ac"] = state["_re"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["literals"], state["backend"])  # type: ignore[misc]


_start_then_index = operator.itemgetter(1, 0)  # (start, literal index) of a match: in C


def _hs_database(literals: Sequence[bytes]) -> Any:
    """A hyperscan block-mode database of ``literals``, from the disk cache when it is there."""
    hs = _hyperscan()
    if hs is None:
        return None
    h = hashlib.sha256()
    h.update(str(getattr(hs, "__version__", "?")).encode())
    for lit in literals:
        h.update(len(lit).to_bytes(4, "little"))
        h.update(lit)
    path = cache_dir() / f"prefilter-{h.hexdigest()[:32]}.hsdb"
    try:
        db = hs.loadb(path.read_bytes(), hs.HS_MODE_BLOCK)
        db.scratch = hs.Scratch(db)  # a database read back has no scratch space of its own
        return db
    except (OSError, hs.error, TypeError, ValueError):
        pass  # none yet, or from another hyperscan: compiled again
    try:
        db = hs.Database(mode=hs.HS_MODE_BLOCK)
        db.compile(
            expressions=list(literals),
            ids=list(range(len(literals))),
            elements=len(literals),
            flags=0,
            literal=True,
        )
    except Exception as e:  # hyperscan's errors are many; any of them: the next backend
        log.warning("hyperscan could not compile the literal prefilter (%s): Aho-Corasick", e)
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # written aside and renamed: a concurrent start never reads half a database
        import tempfile  # only when a cache file is written

        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hsdb-")
        with os.fdopen(fd, "wb") as out:
            out.write(hs.dumpb(db))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: compiled again at the next start
    return db


def speed_report() -> str:
    """One line for ``nanwatch doctor``: which prefilter and iteration-line reader run here."""
    backend = backend_name()
    columns = "off (NANWATCH_COLUMNS=0)" if os.environ.get("NANWATCH_COLUMNS") == "0" else "on"
    note = "" if backend == "hyperscan" else " (pip install 'nanwatch[speed]' adds hyperscan)"
    from .core import status

    core = "compiled core" if status()[0] else "pure Python"
    return f"literal prefilter: {backend}{note}; iteration lines read as columns: {columns}, {core}"
