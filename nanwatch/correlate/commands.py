"""Suggested shell commands: templates from ``alerts/*.toml`` filled with values from logs.

A run name, a work_dir or a tensor name comes from folder and file names that anyone who can
write a log folder chooses, and the filled command is meant to be pasted into a shell. So every
value is quoted for the shell where it lands: outside quotes as ``shlex.quote`` gives it, inside
a template's own quotes (``'{run}'``, ``"{work_dir}/x"``) by closing them around the quoted
value, so a ``'`` or ``$(...)`` in a value is never shell syntax. A value that is unknown
renders as ``'<name>'``, the same quoted fill-in-here placeholder the templates use
(``'<incident id>'``): pasted unedited it is a wrong argument, never a redirection.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def fill_command(template: str, values: Mapping[str, object]) -> str:
    """``template`` with each ``{name}`` in ``values`` replaced by its shell-quoted value."""
    out: list[str] = []
    quote = ""  # the quote character the template has open here: "", "'" or '"'
    i, n = 0, len(template)
    while i < n:
        c = template[i]
        m = _PLACEHOLDER.match(template, i) if c == "{" else None
        if m is not None and m.group(1) in values:
            v = values[m.group(1)]
            text = shlex.quote(f"<{m.group(1)}>" if v is None else str(v))
            # close the template's quote, put the value quoted on its own, reopen it
            out.append(f"{quote}{text}{quote}")
            i = m.end()
            continue
        out.append(c)
        if c == "\\" and quote != "'" and i + 1 < n:
            out.append(template[i + 1])
            i += 2
            continue
        if quote == "" and c in "'\"":
            quote = c
        elif c == quote:
            quote = ""
        i += 1
    return "".join(out)


def check_command(template: str) -> str | None:
    """Why a command template cannot be pasted as it stands (an open quote), or None."""
    quote = ""
    i, n = 0, len(template)
    while i < n:
        c = template[i]
        if c == "\\" and quote != "'":
            i += 2
            continue
        if quote == "" and c in "'\"":
            quote = c
        elif c == quote:
            quote = ""
        i += 1
    if quote:
        return (
            f"a {quote} quote is never closed; values are quoted for the shell by nanwatch, "
            "so write {run} rather than '{run}'"
        )
    return None
