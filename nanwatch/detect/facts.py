"""Run facts a context rule's match tells (versions, world size, timeouts...)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .rules import Rule, convert


def rule_facts(rule: Rule, groups: Mapping[str, Any]) -> dict[str, Any]:
    """The run facts a context rule's match tells: ``facts = { "versions.torch" = "{torch}" }``
    (a template that is one group takes that group's typed value; groups that did not take
    part leave their fact out)."""
    out: dict[str, Any] = {}
    for path, template in rule.facts.items():
        whole = _WHOLE_GROUP.fullmatch(template)
        if whole:
            raw = groups.get(whole.group(1))
            if raw is None or raw == "":
                continue
            typ = rule.types.get(whole.group(1), "str")
            value: Any = convert(raw, typ) if isinstance(raw, str) else raw
        else:
            try:
                value = template.format_map(_Strict(groups))
            except KeyError:
                continue
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


_WHOLE_GROUP = re.compile(r"\{(\w+)\}")


class _Strict(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)

    def __getitem__(self, key: str) -> Any:
        v = super().__getitem__(key)
        if v is None:
            raise KeyError(key)
        return v
