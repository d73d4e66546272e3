"""One msprobe CSV row -> one finding (or nothing).

V1 columns are ``vpp_stage,name,step[,micro_step],<ops...>,shape,dtype``; V2 columns are
``vpp_stage,step,module_name,scope[,micro_step],<ops...>``. A statistic that is NaN is written as
``nan``; ``nans`` is the count of NaN elements (``8`` or ``16.0``).

A row whose every statistic, ``nans``, ``shape`` and ``dtype`` included, is ``nan`` is msprobe's
placeholder for a missing tensor (a None gradient: token-id inputs, wrapper modules), written
(and alerted on) at every step. It is never a finding. A real non-finite tensor has a finite
``nans`` count and a real shape.
"""

from __future__ import annotations

import csv
import math
from functools import lru_cache
from typing import Any

from ..._dc import dataclass
from .names import PARAM_TAGS, PHASE_OF, TAG_OF, locate

CORE_STATS = ("norm", "min", "max", "mean")
_V2_TAG = {
    ("module", "forward"): "actv",
    ("module", "backward"): "actv_grad",
    ("weight_grad", "unreduced"): "grad_unreduced",
    ("weight_grad", "reduced"): "grad_reduced",
    ("optimizer", "exp_avg"): "exp_avg",
    ("optimizer", "exp_avg_sq"): "exp_avg_sq",
    ("param", "param_origin"): "param_origin",
    ("param", "param_updated"): "param_updated",
}
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "+inf": math.inf}


@dataclass(frozen=True)
class Layout:
    """Column positions of one header."""

    header: tuple[str, ...]
    version: int
    name: int
    step: int
    micro: int | None
    scope: int | None
    shape: int | None
    dtype: int | None
    stats: tuple[tuple[str, int], ...]  # (op, column) for every statistic column
    split: int  # how many commas to split on to reach step, micro_step and scope
    nan_tail: bytes  # what follows the key columns in a placeholder row: nan,nan,...,nan
    has_marker: bool  # a nans / zeros / shape column tells placeholders from NaN tensors

    @property
    def key_cols(self) -> tuple[int, int | None]:
        return self.step, self.micro


@lru_cache(maxsize=256)
def layout(header: tuple[str, ...], version: int) -> Layout | None:
    cols = {c: i for i, c in enumerate(header)}
    name = cols.get("module_name" if version == 2 else "name")
    step = cols.get("step")
    if name is None or step is None or "vpp_stage" not in cols:
        return None
    fixed = {"vpp_stage", "name", "module_name", "step", "micro_step", "scope", "shape", "dtype"}
    stats = tuple((c, i) for i, c in enumerate(header) if c not in fixed)
    micro = cols.get("micro_step")
    split = max(step, micro if micro is not None else 0, cols.get("scope") or 0) + 1
    return Layout(
        header=header,
        version=version,
        name=name,
        step=step,
        micro=micro,
        scope=cols.get("scope"),
        shape=cols.get("shape"),
        dtype=cols.get("dtype"),
        stats=stats,
        split=split,
        nan_tail=b",".join([b"nan"] * (len(header) - split)),
        has_marker=bool({"nans", "zeros", "shape"} & set(cols)),
    )


def guess_layout(version: int, family: str, ncols: int) -> Layout | None:
    """Columns of a headerless ``_part_N`` file whose first part is gone (best effort)."""
    if version != 1 or ncols < 5:
        return None
    micro = family in ("actv", "actv_grad")
    head = ["vpp_stage", "name", "step"] + (["micro_step"] if micro else [])
    nops = ncols - len(head) - 2
    if nops < 1:
        return None
    ops = [*CORE_STATS, "nans", "zeros"][:nops] + [f"op{i}" for i in range(max(0, nops - 6))]
    return layout(tuple([*head, *ops, "shape", "dtype"]), version)


def _num(text: str) -> float | None:
    t = text.strip().lower()
    if t in _NONFINITE:
        return _NONFINITE[t]
    try:
        return float(t)
    except ValueError:
        return None


def _shape(text: str) -> list[int] | None:
    t = text.strip()
    if not t.startswith("[") or not t.endswith("]"):
        return None
    inner = t[1:-1].strip()
    if not inner:
        return []
    try:
        return [int(x) for x in inner.split(",")]
    except ValueError:
        return None


def _stat_value(v: float | None) -> Any:
    if v is None:
        return None
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


@dataclass(frozen=True)
class Finding:
    """A non-finite tensor in one row."""

    tensor: str
    tag: str
    phase: str
    module: str
    role: str
    step: int
    micro_step: int | None
    vpp_stage: int | None
    shape: list[int] | None
    dtype: str | None
    value: str  # nan | inf | -inf
    stats: dict[str, Any]

    def fields(self) -> dict[str, Any]:
        f: dict[str, Any] = {
            "tensor": self.tensor,
            "tag": self.tag,
            "phase": self.phase,
            "module": self.module,
            "role": self.role,
            "shape": self.shape,
            "dtype": self.dtype,
            "micro_step": self.micro_step,
            "value": self.value,
        }
        if self.vpp_stage is not None and self.vpp_stage >= 0:
            f["vpp_stage"] = self.vpp_stage
        f.update(self.stats)
        return f


def tag_of(lay: Layout, family: str, scope: str) -> str | None:
    if lay.version == 2:
        return _V2_TAG.get((family, scope))
    return TAG_OF.get(family)


def is_placeholder_tail(lay: Layout, tail: bytes, tag: str) -> bool:
    """Cheap test on the bytes after the key columns (see parse_row for the rule)."""
    if tail.rstrip(b"\r") != lay.nan_tail or lay.version == 2:
        return False
    return lay.has_marker or tag not in PARAM_TAGS


def parse_row(lay: Layout, line: str, family: str) -> tuple[str, Finding | None]:
    """('finite' | 'placeholder' | 'bad' | 'nonfinite' | 'empty', finding).

    'empty': a tensor with no elements (a 0 in its shape), whose statistics msprobe writes as
    NaN; not a NaN, but worth knowing (an empty input breaks some backward kernels).
    """
    try:
        cells = next(csv.reader([line]))
    except (csv.Error, StopIteration):
        return "bad", None
    if len(cells) != len(lay.header):
        return "bad", None
    scope = cells[lay.scope].strip() if lay.scope is not None else ""
    tag = tag_of(lay, family, scope)
    if tag is None:
        return "bad", None
    try:
        step = int(float(cells[lay.step]))
    except ValueError:
        return "bad", None
    values = {op: _num(cells[i]) for op, i in lay.stats}
    shape_txt = cells[lay.shape].strip() if lay.shape is not None else None
    dtype_txt = cells[lay.dtype].strip() if lay.dtype is not None else None
    stats_nan = all(v is not None and math.isnan(v) for v in values.values())
    if (
        stats_nan
        and (shape_txt or "nan").lower() == "nan"
        and (dtype_txt or "nan").lower() == "nan"
    ):
        has_marker = "nans" in values or "zeros" in values or lay.shape is not None
        # Without a nans/zeros/shape column an all-NaN row cannot be told from a NaN tensor; only
        # activation rows have placeholders (a None parameter gradient is never written).
        if has_marker or tag not in PARAM_TAGS:
            return "placeholder", None
    shape = _shape(shape_txt) if shape_txt else None
    empty = shape is not None and 0 in shape
    core = [values[op] for op in CORE_STATS if op in values]
    if not core:
        core = [v for op, v in values.items() if op not in ("nans", "zeros", "id")]
    infs = [v for v in core if v is not None and math.isinf(v)]
    nan_stat = any(v is not None and math.isnan(v) for v in core)
    nans = values.get("nans")
    if nans is not None and math.isfinite(nans):
        # the count decides: min/max/mean of an empty tensor are NaN without any NaN element,
        # and the mean of +inf and -inf is NaN too
        value = "nan" if nans > 0 else ("inf" if infs else "")
    elif empty:
        value = ""
    else:
        value = "nan" if nan_stat else ("inf" if infs else "")
    signed = [v for v in (values.get(op) for op in ("max", "mean", "min")) if v is not None]
    if value == "inf" and any(math.isinf(v) for v in signed):  # the norm of -inf is +inf
        value = "inf" if any(math.isinf(v) and v > 0 for v in signed) else "-inf"
    if not value:
        if not empty:
            return "finite", None
        value = "empty"
    name = cells[lay.name].strip()
    micro = None
    if lay.micro is not None:
        try:
            micro = int(float(cells[lay.micro]))
        except ValueError:
            micro = None
    if lay.version == 2 and family == "weight_grad" and scope == "reduced":
        micro = None  # V2 writes grad_acc_steps there: not a micro-batch index
    vpp: int | None
    try:
        vpp = int(float(cells[0]))
    except ValueError:
        vpp = None
    where = locate(name, tag)
    stats = {op: _stat_value(v) for op, v in values.items()}
    if stats.get("nans") is not None and isinstance(stats["nans"], float):
        stats["nans"] = int(stats["nans"]) if stats["nans"].is_integer() else stats["nans"]
    return ("empty" if value == "empty" else "nonfinite"), Finding(
        tensor=name,
        tag=tag,
        phase=PHASE_OF[tag],
        module=where.module,
        role=where.role,
        step=step,
        micro_step=micro,
        vpp_stage=vpp,
        shape=shape,
        dtype=dtype_txt if dtype_txt and dtype_txt.lower() != "nan" else None,
        value=value,
        stats=stats,
    )
