"""First-NaN localisation inside one step: which rank, which phase, which module.

Within a step the phase order is: weights the step started with (``param_origin``) -> forward
activations -> activation gradients (backward order) -> unreduced gradients -> reduced
gradients -> optimizer state -> updated weights, micro-batches in order. Across ranks, the rank
whose finding comes earliest in that order is the origin: a rank whose unreduced gradient is NaN
while the others' are finite is where it started, and NaN reduced gradients on every rank are its
consequence (the all-reduce spreads it).

Inside the origin rank's step the module comes from what msprobe saw at module boundaries: a
module whose output gradient is finite but whose input or weight gradient is not produced the NaN
in its own backward; a model whose output gradient is already NaN got it from the loss.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from .._dc import dataclass
from ..detect.msprobe.names import locate
from ..store.records import JSON, StoredEvent

_BIG = 1 << 30
PHASE_RANK = {
    "param_origin": -1,
    "actv": 0,
    "actv_grad": 1,
    "grad_unreduced": 2,
    "grad_reduced": 3,
    "exp_avg": 4,
    "exp_avg_sq": 4,
    "param_updated": 5,
}
_VIA_RANK = {"csv": 0, "anomaly": 1, "alert": 2}
GRADS = ("grad_unreduced", "grad_reduced")


@dataclass
class Finding:
    """One non-finite tensor at one (rank, step, micro-step), merged over its sources."""

    ev: StoredEvent
    rank: int | None
    step: int
    tag: str
    tensor: str
    module: str
    role: str
    micro: int | None
    index: int | None  # collection order within the file (CSV rows: the byte offset)
    call_id: int | None
    after_finite: bool | None

    @property
    def fields(self) -> Mapping[str, JSON]:
        return self.ev.fields

    def bucket(self) -> int:
        if self.tag == "param_origin":
            return -1
        if self.tag in ("actv", "actv_grad"):
            return self.micro or 0
        if self.tag == "grad_unreduced":
            return self.micro if self.micro is not None else _BIG
        return _BIG + 1

    def phase_key(self) -> tuple[int, int]:
        return self.bucket(), PHASE_RANK.get(self.tag, 9)

    def key(self) -> tuple[int, int, int, int, int]:
        # a CSV row's byte offset is its collection order within its file (one step each)
        if self.index is not None:
            order: tuple[int, int] = (0, self.index)
        elif self.call_id is not None:
            order = (1, self.call_id)
        else:
            order = (2, 0)
        return (*self.phase_key(), *order, self.ev.id)


def _finding(ev: StoredEvent) -> Finding | None:
    f = ev.fields
    tag, tensor = f.get("tag"), f.get("tensor")
    if tag not in PHASE_RANK or not isinstance(tensor, str) or ev.step is None:
        return None
    if f.get("module") is None:
        where = locate(tensor, tag)
        module, role = where.module, where.role
    else:
        module, role = str(f["module"]), str(f.get("role") or "param")
    micro = f.get("micro_step")
    return Finding(
        ev=ev,
        rank=ev.rank,
        step=int(ev.step),
        tag=tag,
        tensor=tensor,
        module=module,
        role=role,
        micro=micro if isinstance(micro, int) else None,
        index=ev.offset if f.get("via") == "csv" else None,
        call_id=f.get("call_id") if isinstance(f.get("call_id"), int) else None,
        after_finite=f.get("after_finite") if isinstance(f.get("after_finite"), bool) else None,
    )


_Ident = tuple[int | None, int, int | None, str, str]


def merge(events: Iterable[StoredEvent]) -> list[Finding]:
    """One finding per tensor and place: CSV rows first, call ids from the dumps."""
    best: dict[_Ident, Finding] = {}
    calls: dict[_Ident, int] = {}
    for ev in sorted(events, key=lambda e: (_VIA_RANK.get(str(e.fields.get("via")), 3), e.id)):
        fd = _finding(ev)
        if fd is None:
            continue
        ident = (fd.rank, fd.step, fd.micro, fd.tag, fd.tensor)
        if fd.call_id is not None:
            calls.setdefault(ident, fd.call_id)
        best.setdefault(ident, fd)
    out = list(best.values())
    for fd in out:
        if fd.call_id is None:
            fd.call_id = calls.get((fd.rank, fd.step, fd.micro, fd.tag, fd.tensor))
    return out


@dataclass
class Story:
    rank: int | None
    root: Finding
    module: str | None
    first_param: Finding | None
    root_cause: str
    notes: list[str]


def _where(fd: Finding) -> str:
    return f"rank {fd.rank}, step {fd.step}" + (
        f" (micro-step {fd.micro})"
        if fd.micro is not None and fd.tag in ("actv", "actv_grad")
        else ""
    )


def _mod(name: str | None) -> str:
    return f"`{name}`" if name else "the model itself (outside its submodules)"


def localise(findings: list[Finding], *, xy_monitored: bool = True) -> Story:
    """The origin among the findings of one (the earliest) step.

    ``xy_monitored``: activation gradients were recorded, so a module without a non-finite
    output-gradient finding had a finite one.
    """
    by_rank: dict[int | None, list[Finding]] = defaultdict(list)
    for fd in findings:
        by_rank[fd.rank].append(fd)
    for fds in by_rank.values():
        fds.sort(key=Finding.key)
    firsts = {r: fds[0].phase_key() for r, fds in by_rank.items()}
    best = min(firsts.values())
    tied = sorted((r for r, k in firsts.items() if k == best), key=lambda r: (r is None, r or 0))
    rank = tied[0]
    recs = by_rank[rank]
    notes: list[str] = []
    if len(tied) > 1:
        others = ", ".join(str(r) for r in tied[1:])
        notes.append(
            f"ranks {others} show the same first phase at this step; rank {rank} is taken "
            "(the lowest): compare their data loading"
        )
    first = recs[0]
    fp = first_param(recs)
    if first.tag == "param_origin":
        story = Story(
            rank, first, first.module, fp,
            f"the weights of {_mod(first.module)} were already non-finite when step "
            f"{first.step} began on rank {rank} ({first.tensor}): the previous update made them "
            "so, before monitoring saw it",
            notes,
        )  # fmt: skip
    elif first.tag == "actv":
        story = _forward(rank, recs, fp, notes)
    elif first.tag in ("actv_grad", "grad_unreduced"):
        story = _backward(rank, recs, fp, notes, xy_monitored)
    elif first.tag == "grad_reduced":
        story = Story(
            rank, first, first.module, fp,
            f"gradients became non-finite in the reduction on rank {rank} at step {first.step}: "
            f"{first.tensor} is non-finite after the all-reduce, while no rank reported a "
            "non-finite unreduced gradient (with unreduced monitoring on, that points at the "
            "reduction itself, e.g. an fp16 sum overflowing, or at gradient clipping)",
            notes,
        )  # fmt: skip
    else:
        story = Story(
            rank, first, first.module, fp,
            f"the optimizer step produced non-finite values on rank {rank} at step "
            f"{first.step} ({first.tensor}, {first.tag}) from gradients that were finite",
            notes,
        )  # fmt: skip
    story.notes += _cross_rank(rank, by_rank)
    return story


def first_param(recs: list[Finding]) -> Finding | None:
    for tag in GRADS:
        grads = [r for r in recs if r.tag == tag and r.role == "param"]
        if grads:
            first = grads[0]
            # parameters of one module go NaN in the same backward op: name its weight
            same = [
                g for g in grads if g.module == first.module and g.phase_key() == first.phase_key()
            ]
            return next((g for g in same if g.tensor.endswith(".weight")), first)
    return None


def _forward(rank: int | None, recs: list[Finding], fp: Finding | None, notes: list[str]) -> Story:
    fw = [r for r in recs if r.tag == "actv" and r.micro == recs[0].micro]
    nan_in = {r.module for r in fw if r.role == "input"}
    first = fw[0]
    if first.role == "output" and first.module not in nan_in:
        return Story(
            rank, first, first.module, fp,
            f"the NaN was produced inside the forward of {_mod(first.module)} on rank {rank} at "
            f"step {first.step}: its inputs are finite, its output {first.tensor} is not",
            notes,
        )  # fmt: skip
    if first.module == "":
        return Story(
            rank, first, None, fp,
            f"the model's input is already non-finite on {_where(first)} ({first.tensor}): the "
            "NaN comes with the data, before any module",
            notes,
        )  # fmt: skip
    return Story(
        rank, first, first.module or None, fp,
        f"the input of {_mod(first.module)} is already non-finite on {_where(first)} "
        f"({first.tensor}): it comes from code outside the monitored modules",
        notes,
    )  # fmt: skip


def _backward(
    rank: int | None, recs: list[Finding], fp: Finding | None, notes: list[str], xy: bool
) -> Story:
    first = recs[0]
    micro = first.micro if first.tag == "actv_grad" else None
    ag = [r for r in recs if r.tag == "actv_grad" and (micro is None or r.micro == micro)]
    gu = [r for r in recs if r.tag == "grad_unreduced"]
    nan_out = {r.module for r in ag if r.role == "output"}
    root_out = [r for r in ag if r.role == "output" and r.module == ""]
    if root_out:
        head = root_out[0]
        return Story(
            rank, head, None, fp,
            f"the NaN arrives from the loss on {_where(head)}: the gradient at the model's "
            f"output ({head.tensor}) is already non-finite, so the loss (or what computes it "
            "from the model's outputs) produced it; the forward pass was finite",
            notes,
        )  # fmt: skip
    born = [r for r in ag if r.role == "input" and r.module not in nan_out]
    born += [r for r in gu if r.module not in nan_out]
    if born:
        head = born[0]
        if head.tag == "grad_unreduced":
            head = first_param([r for r in gu if r.module == head.module]) or head
        m = head.module
        what = (
            f"its input gradient {head.tensor}"
            if head.tag == "actv_grad"
            else f"the gradient of its parameter {head.tensor}"
        )
        if ag or xy:
            root_cause = (
                f"the NaN was produced inside the backward of {_mod(m)} on {_where(head)}: the "
                f"gradient arriving at its output is finite, {what} is not"
            )
        elif head.after_finite:
            root_cause = (
                f"the NaN was produced inside the backward of {_mod(m)} on {_where(head)}: the "
                f"gradients computed before it in this backward pass are finite, {what} is not "
                "(activation gradients were not monitored: enable xy_distribution to confirm)"
            )
        else:
            # without activation gradients the two cannot be told apart: name the module
            root_cause = (
                f"the first gradient computed in the backward pass on {_where(head)} is already "
                f"non-finite ({head.tensor}): the NaN arrives from the loss or is produced in "
                f"the backward of {_mod(m)} (enable xy_distribution to tell)"
            )
        if fp is not None and fp.module != m:
            notes.append(
                f"{_mod(m)} has no non-finite parameter gradient of its own: the first one is "
                f"{fp.tensor}"
            )
        return Story(rank, head, m or None, fp, root_cause, notes)
    head = next(r for r in ag if r.role == "output") if ag else first
    up = head.module.rpartition(".")[0]
    return Story(
        rank, head, up or None, fp,
        f"the gradient at the output of {_mod(head.module)} is already non-finite on "
        f"{_where(head)} ({head.tensor}) while every monitored module after it is finite: it "
        f"was produced by code outside monitored modules, in the forward of {_mod(up)}",
        notes,
    )  # fmt: skip


def _cross_rank(rank: int | None, by_rank: Mapping[int | None, list[Finding]]) -> list[str]:
    mine = {r.tag for r in by_rank.get(rank, [])}
    if "grad_unreduced" not in mine:
        return []
    clean = sorted(
        r
        for r, fds in by_rank.items()
        if r != rank and r is not None
        and any(f.tag == "grad_reduced" for f in fds)
        and not any(f.tag in ("grad_unreduced", "actv", "actv_grad") for f in fds)
    )  # fmt: skip
    if not clean:
        return []
    return [
        f"{ranks_of(clean)}: unreduced gradients finite, reduced gradients non-finite at the same "
        f"step: the all-reduce spread rank {rank}'s NaN to them"
    ]


def ranks_of(ranks: Sequence[int]) -> str:
    from ..events import ranks_text

    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"
