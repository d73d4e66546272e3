"""Rule packs: detection rules as data (``parsers/*.toml`` and site directories).

A pack is one TOML file::

    [pack]
    id = "mmengine"
    title = "mmengine / mmdet training logs"

    [[prefix]]                      # line heads that carry rank/node; stripped before matching
                                    # (a lookahead-only prefix reads them and strips nothing)
    id = "torchrun.rank"
    pattern = '^\\[(?:rank|default)(?P<rank>\\d+)\\]:\\s?'

    [[rule]]
    id = "mmengine.nonfinite"       # unique across every loaded pack
    kind = "nan"                    # event rules yield an event of this kind
    literals = ["nan", "inf"]       # cheap case-sensitive prefilter: a line must contain one
    pattern = '(?P<tensor>[\\w.]*loss[\\w.]*|grad_norm): (?P<value>nan|inf)'
    message = "{tensor} is {value}" # optional; default: the line itself

    [[rule.example]]                # real-format lines and what they must give (run by the tests)
    line = "... Epoch(train) [1][10/16] ... loss: nan ..."
    event = { kind = "nan", epoch = 1, iter = 10, stage = "train", fields = { tensor = "loss" } }

Rule types: ``event`` (default) yields events; ``context`` updates the stream's state (stage,
epoch, iter, step, ...), optionally extracts ``metrics``; with ``hint = true`` it only sets the
stage of the next event (traceback frames such as ``in val_step``). ``chunk = true`` runs the
pattern over whole chunks instead of prefiltered lines (for lines that occur on every iteration);
such a pattern must not cross a newline.

Named groups: ``rank, local_rank, node, epoch, iter, step, stage, device`` set the event's
attributes, ``ts`` is the line's timestamp, ``iters`` the iterations per epoch, names starting
with ``_`` are ignored, and any other group becomes a field, typed by ``types`` or by the
vocabulary (``timeout_ms`` is an int, ``bytes_requested`` a byte size, ...). ``backend`` and
``device`` values are lower-cased; a negative ``exit_code`` adds its ``signal`` name.

Optional rule keys (all backward compatible):

- ``tier`` (default: the pack's ``[pack] tier``, else ``"family"``): how specific an event rule
  is, one of ``specific`` (one exact message with its codes and numbers: ``EI0002``, a watchdog
  timeout, ``Tried to allocate``), ``family`` (what one library or framework prints) and
  ``generic`` (format-agnostic catch-alls: ``loss: nan`` anywhere, an ``OutOfMemoryError``
  name; a pack of only such rules says ``[pack] tier = "generic"``). Event rules are tried on a
  line tier by tier, most specific first; within a tier in load order: site packs first, then
  the shipped packs by file name, each pack's rules from top to bottom; the first match wins.
  So a pack lists a more specific rule above the rule it refines. Detections of one failure
  report (the lines of one traceback, an HCCL error block, a watchdog message and its
  follow-ups: same kind family, same rank, a few lines apart, no iteration line between them)
  become ONE event: it keeps the position of the first line, takes its kind and message from
  the line of the rule tried first (the later line when one rule matched both: a traceback's
  final exception line), and missing attributes and fields from every line. The numeric
  ``priority`` of earlier versions is refused with the tier to use instead.
- an example's ``claimed_by = "<rule id>"``: the line is one this rule would read but a stronger
  rule takes first; the example passes when that rule took it (precedence, shown on the weaker
  rule's side).
- ``lines`` (int, default 1): the pattern sees this many lines joined with ``\n`` (prefixes
  stripped), for records printed over several lines (torchrun's failure summary).
- ``alone = true``: every matching line is a detection of its own, never folded into a failure
  report (msprobe's alert lines: one line per tensor).
- ``ahead = true``: the report is printed inside the step that the next logged step line (within
  a few lines, after any repeats of the report) names: that step is its position, rather than
  the last one logged before it (a logger's warnings raised while the step logs its values).
- ``set`` on an event rule sets attributes of the event (``set = { stage = "val" }``).
- ``const = { incident = false }``: the event is stored but opens no incident by itself.
- context rules whose pattern has a ``loss``/``iter``/``step`` group or ``metrics`` mark an
  iteration line: it closes open failure reports and clears traceback hints. A hint rule may
  also name a ``rank`` (``RankID:8`` in an error line): it stands for the next events' rank.
- ``entry = true`` on a hint rule: the line names the launch's entry script (a traceback's
  ``<module>`` frame, torchrun's ``train.py FAILED``): every rank runs it, so it also names the
  stage of the reports of other ranks printed just before, and it is weaker than a loop frame
  (``in val_step``), which it never replaces. A stage nothing names stays unknown (null).
- ``opens = "<record>"`` on a context rule: the line opens a record of that name for its rank
  (a Python traceback's ``Traceback (most recent call last):`` header); ``opens = "<record>?"``
  opens it only when no record is open for the rank (a frame line of a traceback whose header
  was cut off, which must not turn an ``Exception ignored in`` record into a failure);
  ``within = "<record>"``
  on an event rule: the rule is only tried while such a record is open (the traceback's final
  exception line, whatever the exception). Any detection on an unindented line of that rank, an
  iteration line, or ``RECORD_LINES`` lines close it. A record opened on the line before is not
  replaced by another name (``Exception ignored in:`` names the traceback that follows it).
- ``rising = "<group>"`` on an event rule: the group is a counter the line prints on every
  report (DeepSpeed's ``skipped=3``); the line is an event only when the counter is above what
  the stream last printed for that rank (the first value above 0 counts), and the event's
  ``new_<group>`` field says by how much. The last values are kept in the stream's state.
- metric groups named ``*_ms`` are converted to seconds.
- ``facts`` on a context rule: run facts the line tells, merged into ``runs.facts`` (what
  ``nanwatch runs --json`` shows and the knowledge base reads):
  ``facts = { "versions.torch" = "{torch}", "device.type" = "cuda" }``. A template that is one
  group takes that group's value, typed by ``types`` (``int``, ``float``, ``bool``, ...); a
  group that did not take part leaves its fact out. Examples check them with ``facts = {...}``.
- ``max_chars`` (int, default 65536): the pattern examines at most this many characters of a
  line; the rest of a longer line is skipped and counted (``nanwatch_lines_capped``).

Every pattern's work per line is bounded (``bounds.py``): a pattern with an unbounded
lookbehind or nested unbounded quantifiers is refused at load, and a match on a long line
has a time budget.

Lines are decoded as UTF-8 (GBK when that fails, else with replacement), ANSI colours are
removed, ``\r``-glued progress updates are read as their last update for context, and a long
line whose match continues on the next line (a terminal's hard wrap) is read joined.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import io
import marshal
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from .._dc import dataclass
from ..errors import RuleError
from ..events import ATTRIBUTES, KINDS, STAGES
from .bounds import LINE_LIMIT, MAX_CHARS_MAX, lint

# Vocabulary types for fields that rules commonly extract.
FIELD_TYPES: dict[str, str] = {
    "seq": "int",
    "timeout_ms": "int",
    "elapsed_ms": "int",
    "remote_rank": "int",
    "exit_code": "int",
    "pid": "int",
    "numel": "int",
    "device_index": "int",
    "world_size": "int",
    "bytes_requested": "bytes",
    "total": "bytes",
    "allocated": "bytes",
    "reserved": "bytes",
    "free": "bytes",
    "ratio": "float",
    "baseline": "float",
    "current": "float",
    "loss_scale": "float",
    "signum": "int",
    "count": "int",
    "rank_size": "int",
    "num_nan": "int",
    "num_inf": "int",
    "heartbeat_timeout_s": "int",
}
_FACT_PATH = re.compile(r"[a-z_]+(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
_INT_ATTRS = {"rank", "local_rank", "epoch", "iter", "step"}
_STATE_KEYS = {"stage", "epoch", "iter", "iters", "step", "rank", "local_rank", "node", "device"}
METRIC_NAMES = ("loss", "grad_norm", "step_time", "data_time", "lr", "memory")
_TYPES = {"int", "float", "str", "bytes", "list", "bool"}

_STAGE_ALIASES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validate": "val",
    "validation": "val",
    "eval": "val",
    "evaluate": "val",
    "evaluation": "val",
    "evaluating": "val",
    "test": "test",
    "testing": "test",
    "predict": "test",
    "prediction": "test",
    "predicting": "test",
    "validating": "val",
    "sanity checking": "val",
    "sanity": "val",
    "dev": "val",
    "cv": "val",  # a recipe's cross-validation pass over the dev set (WeNet's "CV Batch")
    "steps": "train",  # a progress bar that counts optimizer steps or iterations
    "iteration": "train",
    "iterations": "train",
}


def normalize_stage(value: str | None) -> str | None:
    if value is None:
        return None
    return _STAGE_ALIASES.get(value.strip().lower().rstrip(":"))


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?i?B?)?\s*$", re.I)


def parse_bytes(text: str) -> int | None:
    m = _BYTES_RE.match(text)
    if not m:
        return None
    unit = (m.group(2) or "").lower()
    if unit not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[unit])


def convert(value: str, typ: str) -> Any:
    """Convert a captured group to its declared type; unparsable values stay text."""
    try:
        if typ == "int":
            return int(value.replace(",", ""))
        if typ == "float":
            return float(value)
        if typ == "bytes":
            b = parse_bytes(value)
            return value if b is None else b
        if typ == "bool":
            return _BOOLS.get(value.strip().lower(), value)
    except ValueError:
        return value
    return value


@dataclass(frozen=True)
class Example:
    """One ``[[rule.example]]``: real-format lines and what they must give."""

    lines: tuple[str, ...]
    file: str | None
    event: Mapping[str, Any] | None  # None: no event expected
    events: int | None  # expected number of events (when given)
    state: Mapping[str, Any]
    metrics: Mapping[str, Any] | None
    facts: Mapping[str, Any] | None = None  # run facts the lines must tell
    # a line this rule would read that a more specific rule reads first: that rule must take it
    claimed_by: str | None = None
    # ``state`` given and naming nothing to read (``state = {}``, ``{ stage = false }``): the
    # rule must not fire on these lines at all
    reads_nothing: bool = False


@dataclass(frozen=True)
class Prefix:
    """A ``[[prefix]]``: a line head that carries rank/node, stripped before the rules match."""

    id: str
    pack: str
    source: Path
    pattern: str
    cre: Any  # compiled `regex` pattern (str)
    examples: tuple[Example, ...] = ()


@dataclass(frozen=True)
class Rule:
    """A ``[[rule]]`` of a pack, checked (see the module's docstring for its keys)."""

    id: str
    pack: str
    source: Path
    type: str  # event | context
    kind: str | None
    literals: tuple[str, ...]
    pattern: str
    cre: Any  # compiled (str) for line matching
    chunk_cre: Any | None  # compiled (bytes, multiline) for chunk rules
    set: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, str] = field(default_factory=dict)
    const: Mapping[str, Any] = field(default_factory=dict)
    types: Mapping[str, str] = field(default_factory=dict)
    message: str | None = None
    hint: bool = False
    all_matches: bool = False
    examples: tuple[Example, ...] = ()
    groups: tuple[str, ...] = ()
    tier: str = "family"
    lines: int = 1
    alone: bool = False
    ahead: bool = False  # positioned at the step logged right after it (see the module doc)
    progress: bool = False  # an iteration line: closes failure reports, clears hints
    entry: bool = False  # a hint from the launch's entry script: weaker than a loop frame
    facts: Mapping[str, str] = field(default_factory=dict)  # fact path -> template
    max_chars: int = LINE_LIMIT  # characters of a line the pattern examines (see bounds.py)
    opens: str | None = None  # a context rule: the record (traceback) this line opens
    within: str | None = None  # an event rule: only tried inside an open record of this name
    rising: str | None = None  # an event rule: a counter group; only an increase is an event
    columns: str | None = None  # a chunk rule's line head: whole chunks read as columns

    @property
    def chunk(self) -> bool:
        return self.chunk_cre is not None


@dataclass
class RuleSet:
    """Every loaded pack, in load order (site packs before shipped ones)."""

    packs: list[Mapping[str, Any]] = field(default_factory=list)
    prefixes: list[Prefix] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)

    def by_id(self, rule_id: str) -> Rule | Prefix | None:
        for p in self.prefixes:
            if p.id == rule_id:
                return p
        for r in self.rules:
            if r.id == rule_id:
                return r
        return None


_PACK_KEYS = {"id", "title", "description", "url", "tier"}
# most specific first: the order event rules are tried in
TIERS = ("specific", "family", "generic")
DEFAULT_TIER = "family"


def _tier_for(priority: object) -> str:
    """The tier that took the place of a numeric priority (for the message that refuses it)."""
    if isinstance(priority, (int, float)) and not isinstance(priority, bool):
        return "specific" if priority >= 20 else "family" if priority >= 0 else "generic"
    return DEFAULT_TIER


_PREFIX_KEYS = {"id", "pattern", "example", "description"}
_RULE_KEYS = {
    "id",
    "type",
    "kind",
    "literals",
    "pattern",
    "chunk",
    "set",
    "metrics",
    "const",
    "types",
    "message",
    "hint",
    "all",
    "example",
    "description",
    "tier",
    "priority",  # refused with a message naming the tier to use
    "lines",
    "alone",
    "ahead",
    "facts",
    "max_chars",
    "entry",
    "opens",
    "within",
    "rising",
    "columns",
}
_EXAMPLE_KEYS = {
    "line",
    "lines",
    "file",
    "event",
    "events",
    "state",
    "metrics",
    "facts",
    "note",
    "claimed_by",
}


def _fail(src: Path, rule_id: str | None, msg: str) -> RuleError:
    where = f"{src}" + (f": rule {rule_id!r}" if rule_id else "")
    return RuleError(f"{where}: {msg}")


def _check_keys(
    src: Path, rid: str | None, table: Mapping[str, Any], valid: set[str], what: str
) -> None:
    for k in table:
        if k not in valid:
            near = difflib.get_close_matches(k, sorted(valid), n=1, cutoff=0.5)
            hint = (
                f"; did you mean {near[0]!r}?"
                if near
                else f"; valid keys: {', '.join(sorted(valid))}"
            )
            raise _fail(src, rid, f"unknown key {k!r} in {what}{hint}")


class _Lazy:
    """A pattern compiled on first use: a start compiles only what its input needs (most rules
    never see a line with one of their literals). Packs whose text was checked before (the load
    cache, see ``load_rules``) are not compiled at load."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make: Callable[[], Any] | None = make
        self._obj: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        obj = self._obj
        if obj is None:
            assert self._make is not None
            obj = self._obj = self._make()
            self._make = None
        value = getattr(obj, name)
        if callable(value):
            self.__dict__[name] = value  # later look-ups do not come here
        return value


def _compile_line(src: Path, rid: str, pattern: str) -> Any:
    import regex  # imported when a pattern is compiled: a start that reads nothing needs none

    try:
        cre = regex.compile(pattern, regex.V0)
    except regex.error as e:
        raise _fail(src, rid, f"pattern does not compile: {e}") from None
    why = lint(pattern)
    if why is not None:
        raise _fail(src, rid, f"pattern {why}")
    return cre


def _compile_chunk(src: Path, rid: str, pattern: str) -> Any:
    """Chunk rules run on bytes; the stdlib engine is used when it accepts the pattern (faster)."""
    raw = pattern.encode("utf-8")
    try:
        return re.compile(raw, re.M)
    except re.error:
        pass
    import regex

    try:
        return regex.compile(raw, regex.M | regex.V0)
    except regex.error as e:
        raise _fail(src, rid, f"pattern does not compile: {e}") from None


# an example as the load cache keeps it: Example's fields in order (plain data, see _LoadCache)
_ExampleRow = tuple[Any, ...]


def _examples(src: Path, rid: str, raw: object) -> tuple[_ExampleRow, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(src, rid, "example must be an array of tables ([[rule.example]])")
    out = []
    for i, ex in enumerate(raw):
        if not isinstance(ex, dict):
            raise _fail(src, rid, f"example {i} must be a table")
        _check_keys(src, rid, ex, _EXAMPLE_KEYS, f"example {i}")
        if "line" in ex:
            lines: tuple[str, ...] = (str(ex["line"]),)
        elif "lines" in ex and isinstance(ex["lines"], list):
            lines = tuple(str(x) for x in ex["lines"])
        else:
            raise _fail(src, rid, f"example {i} needs `line` or `lines`")
        ev = ex.get("event")
        if ev is False:
            ev = None
        elif ev is not None and not isinstance(ev, dict):
            raise _fail(src, rid, f"example {i}: `event` must be a table or false")
        out.append(
            (
                lines,
                ex.get("file"),
                ev,
                ex.get("events"),
                ex.get("state", {}),
                ex.get("metrics"),
                ex.get("facts"),
                ex.get("claimed_by"),
                "state" in ex
                and not any(v is not False for v in ex["state"].values())
                and not any(k in ex for k in ("event", "events", "metrics", "facts")),
            )
        )
    return tuple(out)


def _make_examples(rows: Sequence[_ExampleRow]) -> tuple[Example, ...]:
    return tuple(Example(*row) for row in rows)


def _claim(src: Path, rid: str, seen: dict[str, Path]) -> None:
    if rid in seen:
        raise _fail(src, rid, f"duplicate id (also in {seen[rid]})")
    seen[rid] = src


def _load_pack(
    src: Path, data: Mapping[str, Any], seen: dict[str, Path], rs: RuleSet
) -> dict[str, Any]:
    """Check one parsed pack and add it to ``rs`` (its patterns compiled: that is the check).
    Returns what the load cache keeps of it, as plain data (see ``_restore_pack``)."""
    kept_prefixes: list[tuple[str, str, tuple[_ExampleRow, ...]]] = []
    kept_rules: list[tuple[dict[str, Any], bool, tuple[_ExampleRow, ...]]] = []
    pack = data.get("pack")
    if not isinstance(pack, dict) or not isinstance(pack.get("id"), str):
        raise _fail(src, None, 'missing [pack] table with an id (e.g. [pack] id = "mypack")')
    _check_keys(src, None, pack, _PACK_KEYS, "[pack]")
    for top in data:
        if top not in {"pack", "prefix", "rule"}:
            raise _fail(
                src, None, f"unknown table {top!r}; a pack has [pack], [[prefix]], [[rule]]"
            )
    pack_id = pack["id"]
    pack_tier = pack.get("tier", DEFAULT_TIER)
    if pack_tier not in TIERS:
        raise _fail(src, None, f"[pack] tier must be one of {', '.join(TIERS)}; got {pack_tier!r}")
    rs.packs.append({**pack, "source": str(src)})

    for raw in data.get("prefix", []):
        rid = raw.get("id")
        if not isinstance(rid, str):
            raise _fail(src, None, "a [[prefix]] entry has no id")
        _check_keys(src, rid, raw, _PREFIX_KEYS, "[[prefix]]")
        _claim(src, rid, seen)
        pat = raw.get("pattern")
        if not isinstance(pat, str) or not pat.startswith("^"):
            raise _fail(src, rid, "a prefix needs a `pattern` anchored with ^")
        cre = _compile_line(src, rid, pat)
        examples = _examples(src, rid, raw.get("example"))
        kept_prefixes.append((rid, pat, examples))
        rs.prefixes.append(Prefix(rid, pack_id, src, pat, cre, _make_examples(examples)))

    for raw in data.get("rule", []):
        rid = raw.get("id")
        if not isinstance(rid, str):
            raise _fail(src, None, "a [[rule]] has no id")
        _check_keys(src, rid, raw, _RULE_KEYS, "[[rule]]")
        _claim(src, rid, seen)
        rtype = raw.get("type", "event")
        if rtype not in ("event", "context"):
            raise _fail(src, rid, f"type must be 'event' or 'context', got {rtype!r}")
        kind = raw.get("kind")
        if rtype == "event" and kind not in KINDS:
            raise _fail(src, rid, f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        lits = raw.get("literals")
        if (
            not isinstance(lits, list)
            or not lits
            or not all(isinstance(x, str) and x for x in lits)
        ):
            raise _fail(src, rid, "`literals` must be a non-empty list of strings")
        pat = raw.get("pattern")
        if not isinstance(pat, str) or not pat:
            raise _fail(src, rid, "missing `pattern`")
        cre = _compile_line(src, rid, pat)
        chunk_cre = _compile_chunk(src, rid, pat) if raw.get("chunk") else None
        groups = tuple(cre.groupindex)
        types = dict(raw.get("types", {}))
        for fname, t in types.items():
            if t not in _TYPES:
                raise _fail(
                    src, rid, f"types.{fname}: unknown type {t!r} (int, float, str, bytes, bool)"
                )
        sets = dict(raw.get("set", {}))
        for k in sets:
            if k not in _STATE_KEYS:
                raise _fail(
                    src, rid, f"set.{k}: not a stream-state key ({', '.join(sorted(_STATE_KEYS))})"
                )
        if "stage" in sets and normalize_stage(str(sets["stage"])) is None:
            raise _fail(src, rid, f"set.stage: expected one of {', '.join(STAGES)}")
        metrics = dict(raw.get("metrics", {}))
        for k, g in metrics.items():
            if k not in METRIC_NAMES:
                raise _fail(src, rid, f"metrics.{k}: unknown metric ({', '.join(METRIC_NAMES)})")
            if g not in groups:
                raise _fail(src, rid, f"metrics.{k}: the pattern has no group named {g!r}")
        if raw.get("hint") and rtype != "context":
            raise _fail(src, rid, "`hint = true` is only for context rules")
        if raw.get("entry") and not raw.get("hint"):
            raise _fail(src, rid, "`entry = true` is only for hint rules (add `hint = true`)")
        facts = raw.get("facts", {})
        if facts and rtype != "context":
            raise _fail(src, rid, "`facts` is only for context rules")
        if not isinstance(facts, dict):
            raise _fail(src, rid, 'facts must be a table: { "versions.torch" = "{torch}" }')
        for path, template in facts.items():
            if not _FACT_PATH.fullmatch(path) or not isinstance(template, str):
                raise _fail(
                    src, rid, f"facts.{path}: a dotted path (versions.torch) to a string template"
                )
            for g in re.findall(r"\{(\w+)\}", template):
                if g not in groups:
                    raise _fail(src, rid, f"facts.{path}: the pattern has no group named {g!r}")
        for a in ATTRIBUTES:
            if a in (raw.get("const") or {}):
                raise _fail(
                    src, rid, f"const.{a}: attributes are set with groups or `set`, not const"
                )
        if "priority" in raw:
            raise _fail(
                src,
                rid,
                f"`priority = {raw['priority']!r}` is no longer read: replace it with "
                f'`tier = "{_tier_for(raw["priority"])}"` (specific, family or generic; within a '
                "tier the rule listed first is tried first)",
            )
        tier = raw.get("tier", pack_tier)
        if tier not in TIERS:
            raise _fail(src, rid, f"tier must be one of {', '.join(TIERS)}; got {tier!r}")
        if "tier" in raw and rtype != "event":
            raise _fail(src, rid, "`tier` is only for event rules (context rules all apply)")
        nlines = raw.get("lines", 1)
        if not isinstance(nlines, int) or isinstance(nlines, bool) or not 1 <= nlines <= 20:
            raise _fail(src, rid, f"lines must be an integer from 1 to 20, got {nlines!r}")
        if nlines > 1 and raw.get("chunk"):
            raise _fail(src, rid, "`lines` and `chunk = true` cannot be combined")
        max_chars = raw.get("max_chars", LINE_LIMIT)
        if (
            not isinstance(max_chars, int)
            or isinstance(max_chars, bool)
            or not 80 <= max_chars <= MAX_CHARS_MAX
        ):
            raise _fail(
                src, rid, f"max_chars must be an integer from 80 to {MAX_CHARS_MAX}: {max_chars!r}"
            )
        opens, within = raw.get("opens"), raw.get("within")
        for key, val, want in (("opens", opens, "context"), ("within", within, "event")):
            if val is None:
                continue
            if rtype != want:
                raise _fail(src, rid, f"`{key}` is only for {want} rules")
            name = val[:-1] if key == "opens" and isinstance(val, str) and val[-1:] == "?" else val
            if not isinstance(name, str) or not name.isidentifier():
                raise _fail(src, rid, f'{key} must name a record, e.g. {key} = "traceback"')
        rising = raw.get("rising")
        if rising is not None:
            if rtype != "event":
                raise _fail(src, rid, "`rising` is only for event rules")
            if not isinstance(rising, str) or rising not in groups:
                raise _fail(
                    src, rid, f"rising must name a group of the pattern (a counter); got {rising!r}"
                )
        columns = raw.get("columns")
        if columns is not None:
            _check_columns(src, rid, raw, columns, groups, sets)
        progress = (
            rtype == "context"
            and not raw.get("hint")
            and (bool(metrics) or bool({"loss", "iter", "step"} & set(groups)))
        )
        examples = _examples(src, rid, raw.get("example"))
        kept = {
            "id": rid,
            "pack": pack_id,
            "type": rtype,
            "kind": kind,
            "literals": tuple(lits),
            "pattern": pat,
            "set": sets,
            "metrics": metrics,
            "const": dict(raw.get("const", {})),
            "types": types,
            "message": raw.get("message"),
            "hint": bool(raw.get("hint", False)),
            "all_matches": bool(raw.get("all", False)),
            "groups": groups,
            "tier": tier,
            "lines": nlines,
            "alone": bool(raw.get("alone", False)),
            "ahead": bool(raw.get("ahead", False)),
            "progress": progress,
            "facts": dict(facts),
            "max_chars": max_chars,
            "entry": bool(raw.get("entry", False)),
            "opens": opens,
            "within": within,
            "rising": rising,
            "columns": columns,
        }
        kept_rules.append((kept, chunk_cre is not None, examples))
        rs.rules.append(
            Rule(
                source=src,
                cre=cre,
                chunk_cre=chunk_cre,
                examples=_make_examples(examples),
                **kept,
            )
        )
    return {"pack": dict(pack), "prefixes": kept_prefixes, "rules": kept_rules}


def _restore_pack(src: Path, kept: Mapping[str, Any], seen: dict[str, Path], rs: RuleSet) -> None:
    """Add a pack checked before (what ``_load_pack`` returned, from the load cache) to ``rs``
    without checking it again: its patterns compile on first use. Ids are still claimed here:
    another pack may have taken one since."""
    pack = kept["pack"]
    prefixes = [
        Prefix(rid, pack["id"], src, pat, _lazy_line(pat), _make_examples(examples))
        for rid, pat, examples in kept["prefixes"]
    ]
    rules = [
        Rule(
            source=src,
            cre=_lazy_line(fields["pattern"]),
            chunk_cre=_lazy_chunk(src, fields["id"], fields["pattern"]) if chunk else None,
            examples=_make_examples(examples),
            **fields,
        )
        for fields, chunk, examples in kept["rules"]
    ]
    for rid in [p.id for p in prefixes] + [r.id for r in rules]:
        _claim(src, rid, seen)
    rs.packs.append({**pack, "source": str(src)})
    rs.prefixes.extend(prefixes)
    rs.rules.extend(rules)


def _lazy_line(pattern: str) -> _Lazy:
    def make() -> Any:
        import regex

        return regex.compile(pattern, regex.V0)

    return _Lazy(make)


def _lazy_chunk(src: Path, rid: str, pattern: str) -> _Lazy:
    return _Lazy(lambda: _compile_chunk(src, rid, pattern))


# stream-state keys a columns rule may set: the rest needs the line engine's bookkeeping
_COLUMN_KEYS = {"stage", "epoch", "iter", "iters", "step"}


def _check_columns(
    src: Path, rid: str, raw: Mapping[str, Any], head: object, groups: tuple[str, ...], sets: Any
) -> None:
    """``columns`` (a line head pattern): only for the chunk rules the column reader can read
    exactly as the line engine does (columns.py)."""
    if not isinstance(head, str) or not head:
        raise _fail(src, rid, "columns must be the pattern of the line's head before the match")
    if not raw.get("chunk") or raw.get("type") != "context" or raw.get("hint"):
        raise _fail(src, rid, "`columns` is only for chunk context rules (chunk = true)")
    try:
        re.compile(head.encode())
    except re.error as e:
        raise _fail(src, rid, f"columns does not compile: {e}") from None
    state = {g for g in groups if g in _STATE_KEYS} | set(sets)
    if "ts" in groups or not state <= _COLUMN_KEYS:
        raise _fail(
            src, rid, f"a columns rule sets only {', '.join(sorted(_COLUMN_KEYS))} (no ts group)"
        )
    for k, v in sets.items():
        if k != "stage" and not isinstance(v, int):
            raise _fail(src, rid, f"set.{k}: a columns rule sets integers")


def pack_files(dirs: Iterable[Path]) -> list[Path]:
    files: list[Path] = []
    for d in dirs:
        if not d.is_dir():
            raise RuleError(f"{d}: rule directory not found; fix [detect] rule_dirs in the config")
        files.extend(sorted(d.glob("*.toml")))
    return files


def load_rules(
    site_dirs: Sequence[str | Path] = (), *, builtin: bool = True, check: bool = True
) -> RuleSet:
    """Load site packs (first: they may take a line before the shipped rules), then shipped ones.

    With ``check`` (the default), every example of the site packs must pass through its own
    rule (``examples.py``), or the load fails naming the file, the rule and the example: a site
    pack is configuration, and a rule that does not read its own lines is a broken one.
    """
    from .resources import data_dir

    shipped = data_dir("parsers")
    # the shipped folder named as a site folder (`rules --check parsers` in a checkout) is read once
    site = [Path(d) for d in site_dirs]
    if builtin:
        site = [d for d in site if d.resolve() != shipped.resolve()]
    dirs = [*site]
    if builtin:
        dirs.append(shipped)
    packs: list[tuple[Path, bytes, str]] = []
    for f in pack_files(dirs):
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise RuleError(f"{f}: cannot read the rule pack: {e}") from None
        packs.append((f, raw, hashlib.sha256(raw).hexdigest()))
    cache = _LoadCache()
    together = hashlib.sha256(" ".join(key for _, _, key in packs).encode()).hexdigest()
    if together in cache.loads and not (check and site):
        # these very packs, together, were checked before: the rules are built from the cache
        # when first looked at (a start that reads no text builds none)
        return _Deferred(lambda: _build(packs, cache, together))
    rs = _build(packs, cache, together)
    if check and site:
        _check_site(rs, set(pack_files(site)))
    return rs


def _build(packs: Sequence[tuple[Path, bytes, str]], cache: _LoadCache, together: str) -> RuleSet:
    """The rule set of ``packs`` (path, text, hash of the text): the packs the cache knows are
    built from it, the others parsed and checked (then kept in the cache)."""
    rs = RuleSet()
    seen: dict[str, Path] = {}
    for f, raw, key in packs:
        kept = cache.get(key)
        if kept is not None:
            _restore_pack(f, kept, seen, rs)
            continue
        # parsed only when the load cache does not know the pack
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover
            import tomli as tomllib
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise RuleError(f"{f}: not a valid TOML rule pack: {e}") from None
        cache.put(key, _load_pack(f, data, seen, rs))
    cache.checked_together(together)
    cache.save()
    return rs


class _Deferred(RuleSet):
    """A rule set whose packs were all checked before, together: its packs, prefixes and rules
    are built (``build``) when first looked at."""

    def __init__(self, build: Callable[[], RuleSet]) -> None:
        # no RuleSet.__init__: the fields are what ``build`` gives, on first use
        self.__dict__["_build"] = build

    def __getattr__(self, name: str) -> Any:
        build = self.__dict__.get("_build") if name in _RULESET_FIELDS else None
        if build is None:
            raise AttributeError(name)
        rs = build()
        self.packs, self.prefixes, self.rules = rs.packs, rs.prefixes, rs.rules
        del self.__dict__["_build"]
        return getattr(self, name)


_RULESET_FIELDS = ("packs", "prefixes", "rules")


class _LoadCache:
    """Packs read and checked before, by the hash of their text: what the check made of each
    (``_load_pack``: every rule's fields, its examples, its pattern's group names), so that a
    start neither parses, checks nor compiles them again (patterns then compile on first use);
    and which sets of packs were loaded together (their ids did not clash), so that a start
    loading the same set builds nothing until a rule is looked at.

    One file in the cache directory, keyed by the code that checks them: two marshal values,
    the sets first (small: a start reads only them), then the packs; marshal, not pickle: plain
    data only, nothing in it runs."""

    def __init__(self) -> None:
        from .prefilter import cache_dir

        h = hashlib.sha256(sys.version.encode())
        # the regex engine's build, without importing it (a start that reads nothing needs none)
        spec = importlib.util.find_spec("regex")
        if spec is not None and spec.origin:
            st = os.stat(spec.origin)
            h.update(f"{spec.origin}:{st.st_mtime_ns}:{st.st_size}".encode())
        for mod in (__file__, lint.__code__.co_filename):
            try:
                h.update(Path(mod).read_bytes())
            except OSError:
                h.update(mod.encode())
        self.path: Path | None = cache_dir() / f"rules-{h.hexdigest()[:24]}.marshal"
        self.loads: set[str] = set()
        self._entries: dict[str, Any] | None = None
        self._rest = b""  # the packs, unmarshalled when one is first asked for
        self.used: set[str] = set()
        self.dirty = False
        if os.environ.get("NANWATCH_NO_RULE_CACHE"):
            self.path = None
            return
        try:
            blob = self.path.read_bytes()
            f = io.BytesIO(blob)
            loads = marshal.load(f)
            if isinstance(loads, list) and all(isinstance(x, str) for x in loads):
                self.loads = set(loads)
                self._rest = blob[f.tell() :]
        except (OSError, EOFError, ValueError, TypeError):
            pass

    @property
    def entries(self) -> dict[str, Any]:
        if self._entries is None:
            self._entries = {}
            try:
                loaded = marshal.loads(self._rest) if self._rest else None
                if isinstance(loaded, dict):
                    self._entries = loaded
            except (EOFError, ValueError, TypeError):
                pass
            self._rest = b""
        return self._entries

    def get(self, key: str) -> Mapping[str, Any] | None:
        got = self.entries.get(key)
        if not (isinstance(got, dict) and {"pack", "prefixes", "rules"} <= got.keys()):
            return None
        self.used.add(key)
        return got

    def put(self, key: str, kept: Mapping[str, Any]) -> None:
        self.entries[key] = kept
        self.used.add(key)
        self.dirty = True

    def checked_together(self, together: str) -> None:
        """The packs of this load were checked together (see ``load_rules``)."""
        if together not in self.loads:
            self.dirty = True
        self.loads = {together}  # the file keeps this load's packs only

    def save(self) -> None:
        if not self.dirty or self.path is None:
            return
        try:
            # the packs of this load only: edited packs do not pile up
            packs = {k: v for k, v in self.entries.items() if k in self.used}
            blob = marshal.dumps(sorted(self.loads)) + marshal.dumps(packs)
        except ValueError:
            return  # a TOML value marshal cannot hold (a date): checked again at each start
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            import tempfile  # only when the cache file is written

            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".rules-")
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only home: checked again at the next start


def _check_site(rs: RuleSet, files: set[Path]) -> None:
    from .examples import check_examples

    items: list[Rule | Prefix] = [p for p in rs.prefixes if p.source in files]
    items.extend(r for r in rs.rules if r.source in files)
    failures = check_examples(rs, items) if items else []
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise RuleError(
            f"{failures[0]}{more} (`nanwatch rules --check {failures[0].source.parent}` "
            "lists every failing example)"
        )
