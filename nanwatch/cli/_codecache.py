"""Generated methods from a cache: what ``dataclasses`` compiles at every start, compiled once.

A command builds the config's, the store's and the detectors' frozen records (some 70
``@dataclass`` classes) as it imports them, and ``dataclasses`` compiles the source text of each
generated method (``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``,
``__delattr__``) with ``exec``: that was a third of an empty scan's start. The texts are the
same at every start, so their code objects are kept in the cache directory (one marshal file
per bytecode version, rewritten when a text was new) and run from there: the same code run
with the same globals and locals, so the same classes.

Only CLI processes install it (``nanwatch.cli``): importing nanwatch as a library (the training
probe, a script) leaves ``dataclasses`` alone. A cache file another user could have written is
not read: what it holds runs.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import importlib.util
import marshal
import os
import sys
import types
from pathlib import Path
from typing import Any

MAX_ENTRIES = 4000  # texts kept across versions of the code before the file starts afresh


class CodeCache:
    """Compiled method texts by their text; ``exec`` runs a text from here."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._codes: dict[str, types.CodeType] | None = None  # read at the first exec
        self.used: set[str] = set()
        self.new = 0

    @property
    def codes(self) -> dict[str, types.CodeType]:
        if self._codes is None:
            self._codes = _load(self.path) if self.path is not None else {}
        return self._codes

    def exec(self, source: Any, globals: dict[str, Any] | None = None, locals: Any = None) -> None:
        if type(source) is str:
            code = self.codes.get(source)
            if code is None:
                # dont_inherit: compiled with dataclasses' own (empty) future flags, as its
                # exec() of the text would be, not with this module's
                code = compile(source, "<string>", "exec", dont_inherit=True)
                self.codes[source] = code
                self.new += 1
            self.used.add(source)
            source = code
        builtins.exec(source, globals, locals)

    def save(self) -> None:
        """Write the cache if this process compiled a text it did not hold (atomically)."""
        if not self.new or self.path is None or self._codes is None:
            return
        codes = self.codes
        if len(codes) > MAX_ENTRIES:  # texts of older code pile up: keep what this run used
            codes = {k: v for k, v in codes.items() if k in self.used}
        try:
            blob = marshal.dumps(codes)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            import tempfile  # only when the cache is written

            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".dataclass-code-")
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
            os.replace(tmp, self.path)
        except (OSError, ValueError):
            pass  # a read-only home: compiled again at the next start
        self.new = 0


def _load(path: Path) -> dict[str, types.CodeType]:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            return {}  # written by someone else (or could have been): not run
        with os.fdopen(fd, "rb", closefd=False) as f:
            got = marshal.loads(f.read())
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(got, dict):
        return {}
    return {k: v for k, v in got.items() if type(k) is str and type(v) is types.CodeType}


def cache_path() -> Path | None:
    if os.environ.get("NANWATCH_NO_CODE_CACHE"):
        return None
    env = os.environ.get("NANWATCH_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base if env else base / "nanwatch"
    tag = f"{sys.implementation.cache_tag}-{importlib.util.MAGIC_NUMBER.hex()}"
    return folder / f"dataclass-code-{tag}.marshal"


_installed: CodeCache | None = None


def install() -> CodeCache | None:
    """Route ``dataclasses``' exec through the cache, once per process."""
    global _installed
    if _installed is not None:
        return _installed
    if "exec" in vars(dataclasses):
        return None  # someone else's hook: left alone
    try:
        path = cache_path()
    except RuntimeError:  # no home folder to find the cache in
        path = None
    cache = CodeCache(path)
    # dataclasses finds exec in its module globals before the builtins
    setattr(dataclasses, "exec", cache.exec)  # noqa: B010
    atexit.register(cache.save)
    _installed = cache
    return cache
