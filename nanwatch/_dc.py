"""``dataclass`` with the same meaning as the standard library's, made faster to define.

The standard decorator compiles six methods per frozen class (``__init__``, ``__repr__``,
``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``); at start-up that is most of the
time nanwatch spends importing itself. Here only the methods that must be generated are
(``__init__`` and the frozen guards); ``__repr__``, ``__eq__`` and ``__hash__`` are shared
functions over the class's fields, with the standard semantics: the fields' ``repr`` and
``compare`` flags, ``NotImplemented`` against another class, a frozen class hashable by its
compared fields and a mutable one unhashable, and a method the class defines itself kept.
Only ``frozen`` and ``slots`` are taken (the options nanwatch uses).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any


def _methods(cls: type, frozen: bool, own: dict[str, Any]) -> type:
    fields = dataclasses.fields(cls)
    shown = tuple(f.name for f in fields if f.repr)
    compared = tuple(f.name for f in fields if f.compare)
    values: Any = operator.attrgetter(*compared) if compared else (lambda self: ())

    if "__repr__" not in own:

        def __repr__(self: Any) -> str:
            inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in shown)
            return f"{self.__class__.__qualname__}({inner})"

        cls.__repr__ = __repr__  # type: ignore[assignment]
    if "__eq__" not in own:

        def __eq__(self: Any, other: Any) -> Any:
            if other.__class__ is self.__class__:
                return values(self) == values(other)
            return NotImplemented

        cls.__eq__ = __eq__  # type: ignore[assignment]
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    if not explicit_hash:
        if frozen:

            def __hash__(self: Any) -> int:
                return hash(values(self))

            cls.__hash__ = __hash__  # type: ignore[assignment]
        else:
            cls.__hash__ = None  # type: ignore[assignment]
    return cls


def _dataclass(cls: Any = None, /, *, frozen: bool = False, slots: bool = False) -> Any:
    def wrap(c: type) -> type:
        own = dict(c.__dict__)
        if not own.get("__doc__"):
            c.__doc__ = c.__name__  # the standard one computes a signature for it
        made: type = dataclasses.dataclass(c, frozen=frozen, slots=slots, repr=False, eq=False)
        return _methods(made, frozen, own)

    return wrap if cls is None else wrap(cls)


if TYPE_CHECKING:
    from dataclasses import dataclass as dataclass
else:
    dataclass = _dataclass
