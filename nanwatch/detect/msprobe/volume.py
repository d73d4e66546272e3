"""How many findings become events: a NaN run can make every tensor non-finite at every step.

Localisation needs a tensor family's first non-finite steps on each rank in full; what came
after only needs to be visible ("rank 3's reduced gradients were still NaN at step 64"). So, per
(rank folder, tag):

- the first ``FULL_STEPS`` steps with a non-finite row: every such row, up to ``FULL_ROWS`` per
  step and file (the first rows in collection order are the ones that tell where it started);
- later steps: one representative row (the step's first non-finite one) at the 3rd and 4th
  non-finite step, then at every power of two (8th, 16th, ...): log-bounded.

The family state travels with every file's stream state (persisted with its offset), so a
restart or a new per-step file continues the count instead of starting over.
"""

from __future__ import annotations

from typing import Any

from ..._dc import dataclass

FULL_STEPS = 2
FULL_ROWS = 512


@dataclass
class Family:
    first: int | None = None  # first step with a non-finite row
    n: int = 0  # how many steps had one so far
    last: int | None = None  # the latest of them

    def to_list(self) -> list[Any]:
        return [self.first, self.n, self.last]

    @classmethod
    def from_list(cls, v: Any) -> Family:
        try:
            first, n, last = v
            return cls(first, int(n), last)
        except (TypeError, ValueError):
            return cls()

    def newer_than(self, other: Family) -> bool:
        return (self.n, self.last or -1) > (other.n, other.last or -1)


def sampled(n: int) -> bool:
    """Is the n-th non-finite step of a family kept as a representative?"""
    return n <= FULL_STEPS + 2 or (n & (n - 1)) == 0


class Volume:
    """Decides, row by row, what to keep. Shared by every stream of one reader."""

    def __init__(self) -> None:
        self.families: dict[tuple[str, str], Family] = {}

    def family(self, folder: str, tag: str, persisted: Any = None) -> Family:
        key = (folder, tag)
        fam = self.families.get(key)
        if fam is None:
            fam = self.families[key] = Family()
        if persisted is not None:
            other = Family.from_list(persisted)
            if other.newer_than(fam):
                fam.first, fam.n, fam.last = other.first, other.n, other.last
        return fam

    @staticmethod
    def drops(fam: Family, step: int, rows_this_step: int) -> bool:
        """Will a row of the family's latest step surely be dropped? (saves parsing it)"""
        if fam.last is None or step != fam.last:
            return False
        if fam.n <= FULL_STEPS:
            return rows_this_step >= FULL_ROWS
        return rows_this_step > 0 or not sampled(fam.n)

    def decide(self, fam: Family, step: int, rows_this_step: int) -> tuple[str, int]:
        """('full' | 'sample' | 'drop', ordinal) for a non-finite row at ``step``."""
        if fam.last is None or step > fam.last:
            fam.n += 1
            fam.last = step
            if fam.first is None:
                fam.first = step
            n = fam.n
        elif step == fam.last:
            n = fam.n
        elif fam.first is None or step <= fam.first:
            # an earlier step showing up late (a part file, a rewrite) that is the first one
            fam.first = step
            n = 1
        else:
            n = FULL_STEPS + 1
        if n <= FULL_STEPS:
            return ("full" if rows_this_step < FULL_ROWS else "drop"), n
        if rows_this_step == 0 and sampled(n):
            return "sample", n
        return "drop", n
