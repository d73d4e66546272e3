"""nanwatch's ``dataclass`` means what the standard library's does: the same instances, the
same equality, hashing, repr, ``replace``, pickling, frozen guards and field flags."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import field

import pytest

from nanwatch._dc import _dataclass


def _pair(frozen: bool, slots: bool) -> tuple[type, type]:
    def make(deco: object, tag: str) -> type:
        class Point:
            x: int
            y: str = "a"
            tags: list[int] = field(default_factory=list)
            secret: str = field(default="s", repr=False)
            seen: int = field(default=0, compare=False)

        name = f"Point_{tag}_{int(frozen)}{int(slots)}"
        Point.__name__ = Point.__qualname__ = name  # a module-level name, for pickle
        made = deco(Point)  # type: ignore[operator]
        globals()[name] = made
        return made  # type: ignore[no-any-return]

    return (
        make(dataclasses.dataclass(frozen=frozen, slots=slots), "std"),
        make(_dataclass(frozen=frozen, slots=slots), "ours"),
    )


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("slots", [False, True])
def test_same_behaviour_as_the_standard_dataclass(frozen: bool, slots: bool) -> None:
    std, ours = _pair(frozen, slots)
    for cls in (std, ours):
        a, b, c = cls(1, "b", [2], "k", 5), cls(1, "b", [2], "k", 9), cls(2)
        assert a == b and a != c and (a == object()) is False
        assert repr(a) == f"{cls.__qualname__}(x=1, y='b', tags=[2], seen=5)"
        assert dataclasses.replace(a, x=3).x == 3
        assert pickle.loads(pickle.dumps(a)) == a
        assert [f.name for f in dataclasses.fields(cls)] == ["x", "y", "tags", "secret", "seen"]
        if frozen:
            with pytest.raises(dataclasses.FrozenInstanceError):
                a.x = 4
            d, e = cls(1, "b", (2,)), cls(1, "b", (2,), seen=3)  # type: ignore[arg-type]
            assert hash(d) == hash(e) and len({d, e}) == 1
        else:
            a.x = 4
            assert a.x == 4
            assert cls.__hash__ is None
    assert std(1) != ours(1)  # instances of two classes are never equal


def test_methods_the_class_defines_are_kept() -> None:
    @_dataclass(frozen=True)
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Named) and other.name.lower() == self.name.lower()

        def __hash__(self) -> int:
            return hash(self.name.lower())

    assert repr(Named("A")) == "<A>"
    assert Named("A") == Named("a") and hash(Named("A")) == hash(Named("a"))

    @_dataclass(frozen=True)
    class OnlyEq:
        name: str

        def __eq__(self, other: object) -> bool:
            return isinstance(other, OnlyEq) and other.name[:1] == self.name[:1]

    # as the standard decorator does: a frozen class that defines only __eq__ gets a field hash
    assert OnlyEq("ab") == OnlyEq("ax") and hash(OnlyEq("ab")) == hash(OnlyEq("ab"))
