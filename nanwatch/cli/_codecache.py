"""Generated methods from a cache: what ``dataclasses`` compiles at every start, compiled once.

A command builds the config's, the store's and the detectors' frozen records (some 70
``@dataclass`` classes) as it imports them, and ``dataclasses`` compiles the source text of each
generated method (``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``,
``__delattr__``) with ``exec``: that was a third of an empty scan's start. The texts are the
same at every start, so their code objects are kept in the cache directory (one marshal file
per module that defines the classes, per bytecode version, rewritten when a text was new) and
run from there: the same code run with the same globals and locals, so the same classes.

Only CLI processes install it (``nanwatch.cli``), and only nanwatch's own classes go through
it: importing nanwatch as a library (the training probe, a script) leaves ``dataclasses``
alone. A cache file another user could have written is not read: what it holds runs.
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

MAX_ENTRIES = 400  # texts kept per module across versions of its code before starting afresh


class CodeCache:
    """Compiled method texts of the classes of ``modules`` (and their submodules), by text;
    ``exec`` runs a text from here."""

    def __init__(self, folder: Path | None, modules: tuple[str, ...] = ("nanwatch",)) -> None:
        self.folder = folder
        self.modules = modules
        self.codes: dict[str, dict[str, types.CodeType]] = {}  # module -> text -> code
        self.used: dict[str, set[str]] = {}
        self.dirty: set[str] = set()
        self.new = 0

    def _ours(self, module: object) -> bool:
        return isinstance(module, str) and any(
            module == m or module.startswith(m + ".") for m in self.modules
        )

    def exec(self, source: Any, globals: dict[str, Any] | None = None, locals: Any = None) -> None:
        # dataclasses runs a class's methods with the globals of the module defining it
        module = globals.get("__name__") if globals is not None else None
        if type(source) is not str:
            builtins.exec(source, globals, locals)
            return
        if not self._ours(module):
            # compiled here, not by exec(): exec() of a text would take this module's future
            # flags (annotations as text) instead of those of dataclasses
            builtins.exec(compile(source, "<string>", "exec", dont_inherit=True), globals, locals)
            return
        assert isinstance(module, str)
        codes = self.codes.get(module)
        if codes is None:
            codes = self.codes[module] = self._load(module)
        code = codes.get(source)
        if code is None:
            code = compile(source, "<string>", "exec", dont_inherit=True)
            codes[source] = code
            self.dirty.add(module)
            self.new += 1
        self.used.setdefault(module, set()).add(source)
        builtins.exec(code, globals, locals)

    def _path(self, module: str) -> Path | None:
        return None if self.folder is None else self.folder / f"{module}.marshal"

    def _load(self, module: str) -> dict[str, types.CodeType]:
        path = self._path(module)
        if path is None:
            return {}
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

    def save(self) -> None:
        """Write the modules of which this process compiled a text (atomically)."""
        if self.folder is None:
            return
        for module in sorted(self.dirty):
            codes = self.codes[module]
            if len(codes) > MAX_ENTRIES:  # texts of older code pile up: keep this run's
                used = self.used.get(module, set())
                codes = {k: v for k, v in codes.items() if k in used}
            path = self._path(module)
            assert path is not None
            try:
                blob = marshal.dumps(codes)
                path.parent.mkdir(parents=True, exist_ok=True)
                import tempfile  # only when the cache is written

                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{module}-")
                with os.fdopen(fd, "wb") as out:
                    out.write(blob)
                os.replace(tmp, path)
            except (OSError, ValueError):
                pass  # a read-only home: compiled again at the next start
        self.dirty.clear()
        self.new = 0


def cache_folder() -> Path | None:
    if os.environ.get("NANWATCH_NO_CODE_CACHE"):
        return None
    env = os.environ.get("NANWATCH_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base if env else base / "nanwatch"
    tag = f"{sys.implementation.cache_tag}-{importlib.util.MAGIC_NUMBER.hex()}"
    return folder / f"dataclass-code-{tag}"


_installed: CodeCache | None = None


def install() -> CodeCache | None:
    """Route ``dataclasses``' exec through the cache, once per process."""
    global _installed
    if _installed is not None:
        return _installed
    if "exec" in vars(dataclasses):
        return None  # someone else's hook: left alone
    try:
        folder = cache_folder()
    except RuntimeError:  # no home folder to find the cache in
        folder = None
    cache = CodeCache(folder)
    # dataclasses finds exec in its module globals before the builtins
    setattr(dataclasses, "exec", cache.exec)  # noqa: B010
    atexit.register(cache.save)
    _installed = cache
    return cache
