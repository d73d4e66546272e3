"""msprobe tensor names -> module names and normalised tags.

msprobe names what it monitors after the model's ``named_modules()`` / ``named_parameters()``:
``{vpp}:{name}[:{micro_step}]/rank{R}/{raw tag}`` in alerts and dumps, the bare ``{name}`` in the
CSV ``name`` column. Parameters end in their attribute (``.weight``, ``.bias``, ``.gamma``...),
activations in ``.input[_i]`` / ``.output[_i]`` (V1) or ``.input.i`` / ``.grad_output.i`` (V2).
Wrappers add ``module.`` (DDP), ``module.module.`` (Megatron), ``_fsdp_wrapped_module.`` (FSDP),
``_orig_mod.`` (torch.compile). The module where a tensor lives is the name without all that.

Versions up to 8.3 shortened parameter and module names by default (``squash_name``): the name
keeps only its tail from the last ``layers.N`` / ``embedding`` / ``final`` / ``output`` / ``norm``
component (``module.decoder.layers.3.attn.weight`` -> ``layers.3.attn.weight``). Such a name is a
suffix of the real one; :func:`suffix_matches` finds the real names in a checkpoint index.
"""

from __future__ import annotations

import re

from ..._dc import dataclass

# raw msprobe tag (dumps, alerts) or CSV file family -> normalised tag (ARCHITECTURE.md)
TAG_OF = {
    "actv": "actv",
    "actv_grad": "actv_grad",
    "acc_grad": "grad_unreduced",
    "pre_grad": "grad_unreduced",
    "grad_unreduced": "grad_unreduced",
    "post_grad": "grad_reduced",
    "grad_reduced": "grad_reduced",
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
    "param_origin": "param_origin",
    "param_updated": "param_updated",
}
PHASE_OF = {
    "actv": "forward",
    "actv_grad": "backward",
    "grad_unreduced": "backward",
    "grad_reduced": "reduce",
    "exp_avg": "optimizer",
    "exp_avg_sq": "optimizer",
    "param_origin": "optimizer",
    "param_updated": "optimizer",
}
PARAM_TAGS = frozenset(
    ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq", "param_origin", "param_updated")
)

# Components that wrappers insert: anywhere for FSDP / checkpointing / compile, leading only for
# DDP, Megatron and Lightning (a user module may well be called `module` deeper down).
_ANYWHERE = frozenset(("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"))
_LEADING = frozenset(("module", "_forward_module"))

_TAG = re.compile(
    r"^(?:(?P<vpp>\d+):)?(?P<name>[^/]*?)(?::(?P<micro>\d+))?/rank(?P<rank>\d+)/(?P<raw>\w+)$"
)
_V1_IO = re.compile(r"^(?P<mod>.*?)\.(?P<io>input|output)(?:_(?P<idx>\d+))?$")
_V2_IO = re.compile(r"^(?P<mod>.*?)\.(?P<io>input|output|grad_input|grad_output)\.(?P<idx>\d+)$")
_SQUASHED = re.compile(r"^(?:layers?\.\d|embeddings?\.|final|output|norm)")


@dataclass(frozen=True)
class TagName:
    """One msprobe tag: ``0:module.embedding.weight:1/rank1/acc_grad``."""

    vpp: int | None
    name: str
    micro_step: int | None
    rank: int
    raw_tag: str

    @property
    def tag(self) -> str | None:
        return TAG_OF.get(self.raw_tag)


def parse_tag(text: str) -> TagName | None:
    m = _TAG.match(text.strip())
    if m is None:
        return None
    return TagName(
        vpp=int(m["vpp"]) if m["vpp"] is not None else None,
        name=m["name"],
        micro_step=int(m["micro"]) if m["micro"] is not None else None,
        rank=int(m["rank"]),
        raw_tag=m["raw"],
    )


def strip_wrappers(path: str) -> str:
    """``module.module._fsdp_wrapped_module.layers.0`` -> ``layers.0``; the root is ``''``."""
    parts = [p for p in path.split(".") if p]
    while parts and parts[0] in _LEADING:
        parts.pop(0)
    return ".".join(p for p in parts if p not in _ANYWHERE)


@dataclass(frozen=True)
class Where:
    """Where a monitored tensor lives: its module and its role there."""

    module: str  # '' for the model itself (root)
    role: str  # input | output | param
    index: int | None = None  # which input/output when a module has several

    @property
    def is_root(self) -> bool:
        return self.module == ""


def locate(name: str, tag: str | None) -> Where:
    """The module of a monitored tensor, from its name and normalised tag."""
    if "/" in name:  # a whole tag was given
        parsed = parse_tag(name)
        if parsed is not None:
            name, tag = parsed.name, parsed.tag or tag
    name = re.sub(r"^\d+:", "", name)
    if tag in ("actv", "actv_grad") or tag is None:
        m = _V2_IO.match(name) or _V1_IO.match(name)
        if m is not None:
            io = m["io"].replace("grad_", "")
            idx = int(m["idx"]) if m["idx"] is not None else None
            return Where(strip_wrappers(m["mod"]), io, idx)
        if tag is not None:
            return Where(strip_wrappers(name), "output")
    for suffix in (".exp_avg_sq", ".exp_avg"):  # Monitor V2 names optimizer state this way
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    module, _, _ = name.rpartition(".")
    return Where(strip_wrappers(module), "param")


def module_of(name: str, tag: str | None) -> str:
    return locate(name, tag).module


def param_key(name: str) -> str:
    """A parameter name without wrappers, for comparing msprobe and checkpoint names."""
    return strip_wrappers(name)


def maybe_squashed(name: str) -> bool:
    """Could this name have been shortened by msprobe's ``squash_name``?"""
    return bool(_SQUASHED.match(strip_wrappers(name)))


def looks_squashed(name: str) -> bool:
    """As written, without a wrapper prefix: squashing drops ``module.`` too."""
    return bool(_SQUASHED.match(re.sub(r"^\d+:", "", name)))


def suffix_matches(short: str, names: list[str]) -> list[str]:
    """Full names that a (possibly squashed) name is the tail of, by whole components."""
    key = param_key(short)
    if not key:
        return []
    tail = "." + key
    return [n for n in names if param_key(n) == key or param_key(n).endswith(tail)]


def parent(module: str) -> str:
    return module.rpartition(".")[0]
