"""Every module's surface is honest: ``__all__`` lists what exists and what the module defines,
and every exception nanwatch defines is a ``NanwatchError`` (one root for callers to catch)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import nanwatch
from nanwatch.errors import NanwatchError

# optional extras: a module that needs one of these is skipped where it is not installed
OPTIONAL = {"torch", "torch_npu", "matplotlib", "psycopg", "psycopg2", "mmengine", "msprobe"}

# known exceptions to the rules below, each to be fixed in its own module, then removed here
NOT_LISTED: set[str] = set()  # "module.name" defined there, public, missing from __all__
NOT_UNDER_ROOT: set[str] = set()  # exceptions outside NanwatchError


def _names() -> list[str]:
    names = ["nanwatch"]
    for info in pkgutil.walk_packages(nanwatch.__path__, "nanwatch."):
        if info.name.rsplit(".", 1)[-1] != "__main__":  # runs the CLI when imported
            names.append(info.name)
    return sorted(names)


MODULES = _names()


PACKAGE = Path(nanwatch.__file__).parent


def _load(name: str) -> ModuleType:
    try:
        # training stacks (mmengine -> torch) warn about themselves on import: not ours to
        # fix; a warning raised from nanwatch's own code still fails the test
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            module = importlib.import_module(name)
    except ImportError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {e.name}, not installed")
        raise
    ours = [w for w in seen if Path(w.filename).is_relative_to(PACKAGE)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    return module


def _defined(module: ModuleType) -> dict[str, object]:
    """Functions and classes written in this module (not imported into it)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }


def test_every_module_is_found() -> None:
    assert len(MODULES) > 50 and "nanwatch.errors" in MODULES and "nanwatch.probe" in MODULES
    assert "nanwatch.__main__" not in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_only_public_names_that_exist(name: str) -> None:
    module = _load(name)
    listed = getattr(module, "__all__", None)
    if listed is None:
        return
    assert len(set(listed)) == len(listed), f"{name}.__all__ lists a name twice"
    missing = [n for n in listed if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names the module does not have: {missing}"
    # dunders such as __version__ are the package's, not private helpers
    private = [
        n for n in listed if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    ]
    assert not private, f"{name}.__all__ lists private names: {private}"


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_every_public_definition(name: str) -> None:
    module = _load(name)
    listed = getattr(module, "__all__", None)
    if listed is None:
        return  # no declared surface: nothing to compare
    left_out = sorted(
        n
        for n in _defined(module)
        if not n.startswith("_") and n not in listed and f"{name}.{n}" not in NOT_LISTED
    )
    assert not left_out, (
        f"{name} defines public {left_out} but its __all__ leaves them out: "
        "list them, or give them a leading _ if they are helpers"
    )


@pytest.mark.parametrize("name", MODULES)
def test_every_exception_is_a_nanwatch_error(name: str) -> None:
    module = _load(name)
    outside = sorted(
        n
        for n, obj in _defined(module).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and not issubclass(obj, NanwatchError)
        and f"{name}.{n}" not in NOT_UNDER_ROOT
    )
    assert not outside, f"{name}: {outside} should subclass nanwatch.errors.NanwatchError"


def test_the_allow_lists_hold_only_real_cases() -> None:
    """An entry fixed in its module must leave the list, so the list only ever shrinks."""
    for entry in sorted(NOT_LISTED | NOT_UNDER_ROOT):
        name, attr = entry.rsplit(".", 1)
        module = _load(name)
        obj = getattr(module, attr, None)
        assert obj is not None and getattr(obj, "__module__", None) == name, entry
        if entry in NOT_UNDER_ROOT:
            assert issubclass(obj, BaseException) and not issubclass(obj, NanwatchError), entry
        else:
            assert attr not in getattr(module, "__all__", ()), entry
