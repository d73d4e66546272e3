"""The detection engine: chunks of complete lines in, events and metrics out.

The hot path works on whole chunks of bytes: chunk rules (iteration lines that occur on every
step) run with one ``finditer`` over the chunk, and one literal prefilter finds the few other
lines worth a closer look. Lines that match neither cost nothing but a newline count.

A failure is usually reported over several lines (a traceback, an HCCL error block, a watchdog
message and its follow-ups). Detections of one report become one event (see ``_report``): the
first line gives its position, the highest-priority line its kind and message, every line its
missing attributes and fields. Reports are tracked per rank in the stream state, so a report
split over two chunks is still one event.
"""

from __future__ import annotations

import dataclasses
import re
import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..events import DEVICES, Event, Metric
from ..stream import LAUNCH_KEYS, StreamState
from . import companion
from .rules import FIELD_TYPES, Rule, RuleSet, convert, normalize_stage
from .timestamps import TimeParser

_NAMED = re.compile(r"\(\?P<\w+>")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# A line that starts a record of its own, never the wrapped tail of the line before it.
_NEW_RECORD = re.compile(
    r"\s*$|\[|\(\w+ pid=|\d{4}-\d\d|\d\d[:/]\d\d|[IWEF]\d{3,4} |Traceback|\s+File \"|frame #|"
    r"During handling|The above exception|Exception raised from"
)
MESSAGE_MAX = 2000
HINT_WINDOW = 400  # lines a traceback stage hint stays valid
RANK_HINT_WINDOW = 40  # lines a rank named by an error line (RankID:8) stays valid
BLOCK_LINES = 40  # lines within which detections of one family are one failure report
WRAP_MIN = 79  # a line at least this long may have been hard-wrapped by a terminal
_FAMILY = {"comm_timeout": "comm", "comm_error": "comm"}
# stream state a context rule may set, in the order ``_set_state`` applies them
_STATE_KEYS = ("stage", "epoch", "iter", "iters", "step", "rank", "local_rank", "node", "device")
_STATE_INTS = frozenset(("epoch", "iter", "iters", "step", "rank", "local_rank"))
_INT_ATTRS = ("rank", "local_rank", "epoch", "iter", "step")
_MERGED_ATTRS = ("time", "rank", "local_rank", "node", "epoch", "iter", "step", "stage", "device")
_DEVICE_ALIASES = {"gpu": "cuda", "hip": "cuda", "ascend": "npu"}
MEMORY_PRIORITY = -100  # a companion memory summary never outranks a rule's detection


def decode_line(raw: bytes) -> str:
    """Bytes of one line -> clean text: UTF-8 (GBK tried when UTF-8 fails), no ANSI, no CR."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        try:
            text = raw.decode("gb18030")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\x00" in text:
        text = text.replace("\x00", "")
    return text.rstrip("\r\n")


def _device(value: Any) -> str | None:
    v = str(value).strip().lower()
    v = _DEVICE_ALIASES.get(v, v)
    return v if v in DEVICES else None


class _Compiled:
    """Per-RuleSet precomputation shared by every stream.

    Every rule's literals go into one Aho-Corasick automaton (``ahocorasick_rs``, hundreds of
    MB/s whatever the number of literals); a line none of them occurs in is never looked at.
    Without the package a regex alternation does the same job, much more slowly.
    """

    def __init__(self, rules: RuleSet, *, automaton: bool = True) -> None:
        self.rules = rules
        self.chunk_rules = [r for r in rules.rules if r.chunk]
        self.line_rules = [r for r in rules.rules if not r.chunk]
        lits = sorted({lit.encode("utf-8") for r in rules.rules for lit in r.literals})
        self.literals = lits
        # literal index -> (does a line rule use it, the chunk rules that use it)
        self.lit_line = [any(lit.decode() in r.literals for r in self.line_rules) for lit in lits]
        self.lit_chunk = [
            frozenset(i for i, r in enumerate(self.chunk_rules) if lit.decode() in r.literals)
            for lit in lits
        ]
        self.chunk_plans = [_ChunkPlan(r) for r in self.chunk_rules]
        self._union: dict[tuple[frozenset[int], frozenset[int]], frozenset[int]] = {}
        self._plans: dict[frozenset[int], tuple[_ChunkPlan, ...]] = {}
        self.ac: Any = None
        self.prefilter: Any = None
        if automaton and lits:
            try:
                import ahocorasick_rs

                # a DFA: ~1.5x the default NFA's speed on log text, for ~1 MB of tables
                self.ac = ahocorasick_rs.BytesAhoCorasick(
                    lits, implementation=ahocorasick_rs.Implementation.DFA
                )
            except ImportError:  # pragma: no cover - a platform without the wheel
                self.ac = None
        if self.ac is None and lits:
            by_len = sorted(lits, key=len, reverse=True)
            self.prefilter = re.compile(b"|".join(re.escape(lit) for lit in by_len))
            self.lit_index = {lit: i for i, lit in enumerate(lits)}
        self.context_rules = [r for r in self.line_rules if r.type == "context"]
        # first match wins: higher priority first, load order (site packs first) among equals
        self.event_rules = sorted(
            (r for r in self.line_rules if r.type == "event"), key=lambda r: -r.priority
        )
        # literal index -> positions of the rules that use it (a line only tries those)
        self.lit_ctx = [
            tuple(i for i, r in enumerate(self.context_rules) if lit.decode() in r.literals)
            for lit in lits
        ]
        self.lit_ev = [
            tuple(i for i, r in enumerate(self.event_rules) if lit.decode() in r.literals)
            for lit in lits
        ]
        # One cheap bytes check tells whether a chunk-rule line carries a prefix at all.
        alts = [_NAMED.sub("(?:", p.pattern.lstrip("^")) for p in rules.prefixes]
        self.any_prefix: Any = None
        if alts:
            raw = ("(?:" + "|".join(f"(?:{a})" for a in alts) + ")").encode("utf-8")
            try:
                self.any_prefix = re.compile(raw)
            except re.error:
                import regex

                self.any_prefix = regex.compile(raw, regex.V0)

    def _found(self, chunk: bytes) -> list[tuple[int, int, int]]:
        """(literal index, start, end) of every literal occurrence, overlapping ones included."""
        if self.ac is not None:
            found: list[tuple[int, int, int]] = self.ac.find_matches_as_indexes(
                chunk, overlapping=True
            )
            return found
        found = []
        if self.prefilter is not None:
            # overlapping occurrences are found by restarting one byte after each hit
            pos = 0
            while True:
                m = self.prefilter.search(chunk, pos)
                if m is None:
                    break
                found.append((self.lit_index[m.group()], m.start(), m.end()))
                pos = m.start() + 1
        return found

    def lines(self, chunk: bytes) -> dict[int, list[Any]]:
        """The lines worth a look: start -> [end, literals of line rules it holds (or None),
        the chunk rules whose literals it holds (or None)]."""
        out: dict[int, list[Any]] = {}
        lit_line, lit_chunk, union = self.lit_line, self.lit_chunk, self._union
        line_start = line_end = -1
        entry: list[Any] = []
        for idx, s, _ in self._found(chunk):
            if not line_start <= s < line_end:
                line_start = chunk.rfind(b"\n", 0, s) + 1
                line_end = chunk.find(b"\n", s)
                if line_end < 0:
                    line_end = len(chunk)
                got = out.get(line_start)
                if got is None:
                    got = out[line_start] = [line_end, None, None]
                entry = got
            if lit_line[idx]:
                if entry[1] is None:
                    entry[1] = {idx}
                else:
                    entry[1].add(idx)
            rules = lit_chunk[idx]
            if rules:
                # the rule sets are shared frozensets: their unions are kept, never mutated
                old = entry[2]
                if old is None or old == rules:
                    entry[2] = rules
                else:
                    both = union.get((old, rules))
                    if both is None:
                        both = union[(old, rules)] = old | rules
                    entry[2] = both
        return out

    def scan(self, chunk: bytes) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
        """Starts of the lines worth a look: for line rules, and per chunk rule."""
        candidates: dict[int, set[int]] = {}
        chunk_hits: dict[int, set[int]] = {}
        for start, (_, lits, rules) in self.lines(chunk).items():
            if lits is not None:
                candidates[start] = lits
            if rules is not None:
                chunk_hits[start] = set(rules)
        return candidates, chunk_hits

    def plans(self, rules: frozenset[int]) -> tuple[_ChunkPlan, ...]:
        """The chunk rules of a set of indexes, in rule order."""
        got = self._plans.get(rules)
        if got is None:
            got = self._plans[rules] = tuple(self.chunk_plans[i] for i in sorted(rules))
        return got


class _ChunkPlan:
    """What applying one chunk rule to a match needs, worked out once per rule.

    A chunk rule fires on every iteration line of a run (hundreds of thousands in a catch-up
    scan), so its state keys, metric groups and Metric field order are resolved here.
    """

    __slots__ = ("cre", "keys", "metrics", "rule", "stages", "ts")

    def __init__(self, rule: Rule) -> None:
        assert rule.chunk_cre is not None
        names = set(rule.chunk_cre.groupindex)
        self.rule = rule
        self.cre = rule.chunk_cre
        index = {name: i - 1 for name, i in rule.chunk_cre.groupindex.items()}  # in groups()
        # (state key, the rule's constant for it or None, the group's place in groups())
        self.keys = tuple(
            (k, rule.set.get(k), index.get(k, -1))
            for k in _STATE_KEYS
            if k in names or k in rule.set
        )
        self.ts = index.get("ts", -1)
        # (group's place, value in ms?) per Metric field after ``time``, None: not extracted
        self.metrics: tuple[tuple[int, bool] | None, ...] | None = None
        if rule.metrics:
            self.metrics = tuple(
                (index[rule.metrics[n]], rule.metrics[n].endswith("_ms"))
                if n in rule.metrics
                else None
                for n in Metric._fields[7:]
            )
        self.stages: dict[bytes, str | None] = {}  # a stage group's bytes -> normalised stage


def _number(raw: bytes | None) -> float | None:
    """A metric group's text as a float (None when it is not one), as ``float(text)`` reads it."""
    if raw is None:
        return None
    try:
        return float(raw.strip().rstrip(b",|"))
    except ValueError:
        pass
    # not ASCII: what the decoded text says (Unicode spaces and digits)
    try:
        return float(raw.decode("utf-8", "replace").strip().rstrip(",|"))
    except ValueError:
        return None


def _metric_values(
    g: tuple[bytes | None, ...], specs: tuple[tuple[int, bool] | None, ...]
) -> list[float | None]:
    out: list[float | None] = []
    for spec in specs:
        if spec is None:
            out.append(None)
            continue
        raw = g[spec[0]]
        if raw is None:
            out.append(None)
            continue
        try:
            # float() ignores surrounding whitespace itself; a trailing "," or "|" fails here
            v: float | None = float(raw)
        except ValueError:
            v = _number(raw)
        if v is not None and spec[1]:
            v /= 1000.0
        out.append(v)
    return out


@dataclass
class _Feed:
    """Scratch space of one ``feed`` call."""

    chunk: bytes
    base: int
    file: str | None
    events: list[Event] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)
    opened: dict[str, int] = field(default_factory=dict)  # report key -> index in events
    prios: dict[int, int] = field(default_factory=dict)  # event index -> its kind's priority
    skip_to: int = -1  # lines consumed by a multi-line match end here
    first_epoch: tuple[int, int] | None = None  # (line, epoch) where the stream named its first
    facts: list[dict[str, Any]] = field(default_factory=list)  # run facts the lines told


class Detector:
    """Applies a RuleSet to streams. Stateless itself: each stream passes its StreamState."""

    def __init__(
        self, rules: RuleSet, *, default_year: int | None = None, automaton: bool = True
    ) -> None:
        self._c = _Compiled(rules, automaton=automaton)
        self.rules = rules
        self.times = TimeParser(default_year)

    # -- public ----------------------------------------------------------------------------------

    def feed(
        self,
        chunk: bytes,
        base_offset: int,
        state: StreamState,
        file: str | None = None,
        *,
        facts: list[dict[str, Any]] | None = None,
    ) -> tuple[list[Event], list[Metric]]:
        """Process ``chunk`` (complete lines only) that starts at byte ``base_offset``.

        Updates ``state`` in place (line count, context) and returns what the lines yield.
        Run facts the lines tell (versions, world size, timeouts...) are appended to ``facts``
        when it is given.
        """
        c = self._c
        lines = c.lines(chunk)
        # the in-process companion's records (one cheap search; most chunks have none)
        records = companion.line_starts(chunk) if companion.PREFIX in chunk else set()
        if not lines and not records:
            state.line_no += chunk.count(b"\n")
            return [], []
        # the pipeline hands shallow copies of a state around: never mutate a shared dict
        state.blocks = {k: list(v) for k, v in state.blocks.items()}
        f = _Feed(chunk, base_offset, file)
        any_prefix = c.any_prefix
        line_no = state.line_no
        pos = 0
        for start in sorted(lines.keys() | records if records else lines):
            if start in records:
                # a structured record: read whole, never by the rule packs
                line_no += chunk.count(b"\n", pos, start)
                pos = start
                end = chunk.find(b"\n", start)
                self._record(
                    chunk[start : end if end >= 0 else len(chunk)], state, line_no + 1, start, f
                )
                continue
            end, present, rules = lines[start]
            # chunk rules: one bytes match on each line that holds one of their literals
            hits: list[tuple[_ChunkPlan, Any]] | None = None
            if rules is not None:
                for plan in c.plans(rules):
                    m = plan.cre.search(chunk, start, end)
                    if m is not None:
                        if hits is None:
                            hits = [(plan, m)]
                        else:
                            hits.append((plan, m))
            is_candidate = present is not None and start >= f.skip_to
            if hits is None and not is_candidate:
                continue
            line_no += chunk.count(b"\n", pos, start)
            pos = start
            this_line = line_no + 1
            prefix_attrs: dict[str, Any] = {}
            text = raw = ""
            no_epoch = state.epoch is None
            if is_candidate or (any_prefix is not None and any_prefix.match(chunk, start)):
                raw = decode_line(chunk[start:end])
                text, prefix_attrs = self._strip_prefixes(raw)
            if hits is not None:
                for plan, m in hits:
                    self._apply_chunk_rule(
                        plan,
                        m,
                        state,
                        base_offset,
                        start,
                        this_line,
                        prefix_attrs,
                        f.metrics,
                        chunk,
                    )
            if is_candidate:
                self._line(text, raw, prefix_attrs, state, this_line, start, end, f, present)
            if no_epoch and state.epoch is not None and f.first_epoch is None:
                f.first_epoch = (this_line, state.epoch)
        state.line_no += chunk.count(b"\n")
        if facts is not None:
            facts.extend(f.facts)
        if f.first_epoch is not None:
            # a report printed before the stream named any epoch belongs to the epoch that the
            # progress lines right after it name
            at, epoch = f.first_epoch
            f.events = [
                dataclasses.replace(e, epoch=epoch)
                if e.epoch is None and e.line is not None and 0 < at - e.line <= BLOCK_LINES
                else e
                for e in f.events
            ]
        # nanwatch follows training runs: a stream says when it validates or tests
        events = [e if e.stage else dataclasses.replace(e, stage="train") for e in f.events]
        return events, f.metrics

    def explain(self, text: str) -> dict[str, Any]:
        """Which rules match ``text`` (one or more lines) and the events it gives."""
        matches: list[dict[str, Any]] = []
        for raw_line in text.splitlines() or [""]:
            line = decode_line(raw_line.encode("utf-8"))
            stripped, prefix_attrs = self._strip_prefixes(line)
            if prefix_attrs or stripped != line:
                for p in self.rules.prefixes:
                    if p.cre.match(line):
                        matches.append(
                            {"rule": p.id, "type": "prefix", "pack": p.pack, "values": prefix_attrs}
                        )
                        break
            for r in self.rules.rules:
                if not any(lit in stripped for lit in r.literals):
                    continue
                m = r.cre.search(stripped)
                if m:
                    vals = {k: v for k, v in m.groupdict().items() if v is not None}
                    matches.append(
                        {
                            "rule": r.id,
                            "type": "hint" if r.hint else r.type,
                            "kind": r.kind,
                            "pack": r.pack,
                            "priority": r.priority,
                            "values": vals,
                        }
                    )
        state = StreamState()
        data = "".join(x + "\n" for x in text.splitlines()).encode("utf-8")
        facts: list[dict[str, Any]] = []
        events, metrics = self.feed(data, 0, state, None, facts=facts)
        return {
            "matches": matches,
            "events": [dataclasses.asdict(e) for e in events],
            "metrics": [m._asdict() for m in metrics],
            "facts": companion.run_update({}, facts),
            "state": {
                k: getattr(state, k)
                for k in ("stage", "epoch", "iter", "step", "rank")
                if getattr(state, k) is not None
            },
        }

    # -- internals -------------------------------------------------------------------------------

    def _strip_prefixes(self, text: str) -> tuple[str, dict[str, Any]]:
        attrs: dict[str, Any] = {}
        for _ in range(4):
            for p in self.rules.prefixes:
                m = p.cre.match(text)
                if m and m.end() > 0:
                    for k, v in m.groupdict().items():
                        if v is None or k.startswith("_"):
                            continue
                        if k in ("rank", "local_rank"):
                            attrs.setdefault(k, int(v))
                        elif k in ("node", "device"):
                            attrs.setdefault(k, v)
                    text = text[m.end() :]
                    break
            else:
                break
        return text, attrs

    def _record(self, raw: bytes, state: StreamState, line_no: int, start: int, f: _Feed) -> None:
        """A companion record (see ``companion.py``)."""
        text, prefix_attrs = self._strip_prefixes(decode_line(raw))
        rec = companion.parse(text)
        if rec is None:
            return
        kind, data = rec
        when = companion.record_time(data)
        if when is not None:
            state.last_time = when  # a traceback after it has no time of its own
        if kind == "FACTS":
            told = companion.run_facts(data)
            if told:
                f.facts.append(told)
            state.device = state.device or companion.device_type(told)
            rank = told.get("rank")
            if isinstance(rank, int) and "rank" not in prefix_attrs:
                self._announced(state, rank)
            return
        if kind == "STAGE":
            state.stage = companion.stage_after(data, state.stage)
            return
        where = {
            "offset": f.base + start,
            "file": f.file,
            "line": line_no,
            "rank": prefix_attrs.get("rank", state.rank),
            "local_rank": prefix_attrs.get("local_rank", state.local_rank),
            "node": prefix_attrs.get("node", state.node),
            "epoch": state.epoch,
            "iter": state.iter,
            "step": state.step,
            "stage": state.stage,
            "device": state.device,
            "time": state.last_time,
        }
        if kind == "DATA":
            f.events.append(companion.data_event(data, **where))
        elif kind == "MEMORY":
            ev = companion.memory_event(data, **where)
            if ev is not None:
                # below every rule: the traceback's own line keeps the report's kind and message,
                # the summary adds what held the memory
                self._report(ev, MEMORY_PRIORITY, state, line_no, f)

    @staticmethod
    def _announced(state: StreamState, rank: int) -> None:
        """A process announced its rank in this stream: the stream is that rank's, unless
        another rank announces itself in it too (stdout and stderr of several ranks)."""
        if state.announced is None:
            state.announced = rank
            if state.rank is None:
                state.rank = rank
        elif state.announced not in (rank, -1):
            if state.rank == state.announced:
                state.rank = None
            state.announced = -1

    def _following(self, chunk: bytes, end: int, n: int) -> list[tuple[str, int]]:
        """Up to ``n`` lines after the one ending at ``end``: (text without prefixes, end)."""
        out: list[tuple[str, int]] = []
        pos = end
        while len(out) < n and pos < len(chunk):
            start = pos + 1
            if start > len(chunk):
                break
            nxt = chunk.find(b"\n", start)
            if nxt < 0:
                nxt = len(chunk)
            if start == nxt and start == len(chunk):
                break
            text, _ = self._strip_prefixes(decode_line(chunk[start:nxt]))
            out.append((text, nxt))
            pos = nxt
        return out

    def _set_state(
        self,
        state: StreamState,
        values: Mapping[str, Any],
        line_no: int,
        hint: bool,
    ) -> None:
        stage = values.get("stage")
        if stage is not None:
            stage = normalize_stage(str(stage))
        if hint:
            if stage:
                state.hint_stage = stage
                state.hint_line = line_no
            rank = values.get("rank")
            if rank is not None:
                try:
                    state.hint_rank = int(rank)
                    state.hint_rank_line = line_no
                except (TypeError, ValueError):
                    pass
            return
        if stage:
            if stage != state.stage:
                state.hint_stage = None
            state.stage = stage
        for key in ("epoch", "iter", "iters", "step", "rank", "local_rank"):
            v = values.get(key)
            if v is not None and v != "":
                try:
                    setattr(state, key, int(v))
                except (TypeError, ValueError):
                    pass
        for key in ("node", "device"):
            v = values.get(key)
            if v:
                setattr(state, key, str(v))
        if not LAUNCH_KEYS.isdisjoint(values):  # a launch fact (parsers/launch.toml)
            launch = {k: str(v) for k, v in values.items() if k in LAUNCH_KEYS and v}
            if launch:
                state.launch = {**(state.launch or {}), **launch}
        # Epoch-based loops print the iteration within the epoch; the global step follows.
        if values.get("step") is None and state.stage in (None, "train"):
            if state.epoch is not None and state.iter is not None and state.iters:
                state.step = (state.epoch - 1) * state.iters + state.iter
            elif state.iter is not None and state.epoch is None:
                state.step = state.iter

    @staticmethod
    def _progress(state: StreamState, line_no: int) -> None:
        """An iteration line: earlier failure reports and traceback hints are over."""
        state.progress_line = line_no
        state.hint_stage = None
        state.hint_rank = None
        if state.blocks:
            state.blocks = {}

    def _apply_chunk_rule(
        self,
        plan: _ChunkPlan,
        m: Any,
        state: StreamState,
        base_offset: int,
        line_start: int,
        line_no: int,
        prefix_attrs: Mapping[str, Any],
        metrics: list[Metric],
        chunk: bytes,
    ) -> None:
        rule = plan.rule
        g = m.groups()
        if rule.hint:
            values: dict[str, Any] = {
                k: v.decode("utf-8", "replace") for k, v in m.groupdict().items() if v is not None
            }
            values.update(rule.set)
            self._set_state(state, values, line_no, True)
        else:
            self._chunk_state(plan, g, state)
        if rule.progress:
            self._progress(state, line_no)
        raw_ts = g[plan.ts] if plan.ts >= 0 else None
        if raw_ts is not None:
            ts = raw_ts.decode("utf-8", "replace")
            when = self.times.parse(ts) if ts else None
        else:
            # the line's own timestamp, from its head (chunk patterns start at their literal)
            when = self.times.parse_bytes(chunk[line_start : min(m.start(), line_start + 80)])
        if when:
            state.last_time = when
        if plan.metrics is not None:
            metrics.append(
                Metric._make(
                    (
                        base_offset + line_start,
                        prefix_attrs.get("rank", state.rank),
                        state.step,
                        state.epoch,
                        state.iter,
                        state.stage,
                        when,
                        *_metric_values(g, plan.metrics),
                    )
                )
            )

    @staticmethod
    def _chunk_state(plan: _ChunkPlan, g: tuple[bytes | None, ...], state: StreamState) -> None:
        """``_set_state`` (not a hint) for a chunk rule's match, limited to the keys it has."""
        step_given = False
        for key, const, at in plan.keys:
            v: Any = const
            if const is None:
                b = g[at]
                if b is None:
                    continue
                if key == "stage":
                    stage = plan.stages.get(b, "")
                    if stage == "":
                        if len(plan.stages) > 64:
                            plan.stages.clear()
                        stage = plan.stages[b] = normalize_stage(b.decode("utf-8", "replace"))
                    if stage:
                        if stage != state.stage:
                            state.hint_stage = None
                        state.stage = stage
                    continue
                if key in _STATE_INTS:
                    if key == "step":
                        step_given = True
                    try:
                        setattr(state, key, int(b))
                        continue
                    except ValueError:
                        pass  # not ASCII digits: what the decoded text says
                v = b.decode("utf-8", "replace")
            if key == "stage":
                stage = normalize_stage(str(v))
                if stage:
                    if stage != state.stage:
                        state.hint_stage = None
                    state.stage = stage
            elif key in _STATE_INTS:
                if key == "step":
                    step_given = True
                if v != "":
                    try:
                        setattr(state, key, int(v))
                    except (TypeError, ValueError):
                        pass
            elif v:
                setattr(state, key, str(v))
        # Epoch-based loops print the iteration within the epoch; the global step follows.
        if not step_given and state.stage in (None, "train"):
            if state.epoch is not None and state.iter is not None and state.iters:
                state.step = (state.epoch - 1) * state.iters + state.iter
            elif state.iter is not None and state.epoch is None:
                state.step = state.iter

    def _metric(
        self,
        rule: Rule,
        g: Mapping[str, str | None],
        state: StreamState,
        offset: int,
        when: str | None,
        prefix_attrs: Mapping[str, Any],
    ) -> Metric:
        vals: dict[str, float | None] = {}
        for name, group in rule.metrics.items():
            raw = g.get(group)
            v: float | None = None
            if raw is not None:
                try:
                    v = float(raw.strip().rstrip(",|"))
                    if group.endswith("_ms"):
                        v /= 1000.0
                except ValueError:
                    v = None
            vals[name] = v
        rank = prefix_attrs.get("rank", state.rank)
        return Metric(
            offset=offset,
            rank=rank,
            step=state.step,
            epoch=state.epoch,
            iter=state.iter,
            stage=state.stage,
            time=when,
            **vals,
        )

    def _line(
        self,
        text: str,
        raw: str,
        prefix_attrs: Mapping[str, Any],
        state: StreamState,
        line_no: int,
        start: int,
        end: int,
        f: _Feed,
        present: set[int] | None = None,
    ) -> None:
        c = self._c
        if present is None:
            ctx_rules, ev_rules = c.context_rules, c.event_rules
        else:
            ctx_ids: set[int] = set()
            ev_ids: set[int] = set()
            for idx in present:
                ctx_ids.update(c.lit_ctx[idx])
                ev_ids.update(c.lit_ev[idx])
            ctx_rules = [c.context_rules[i] for i in sorted(ctx_ids)]
            ev_rules = [c.event_rules[i] for i in sorted(ev_ids)]
        when: str | None = None
        ctx_text = text
        if "\r" in text:
            # a progress bar redrawn with \r: its context is the last update; event patterns
            # never cross from one update to the next
            parts = [p for p in text.split("\r") if p.strip()]
            ctx_text = parts[-1] if parts else ""
            text = text.replace("\r", "\n")
        for rule in ctx_rules:
            if not any(lit in ctx_text for lit in rule.literals):
                continue
            m = rule.cre.search(ctx_text)
            if m is None:
                continue
            g = m.groupdict()
            values: dict[str, Any] = {k: v for k, v in g.items() if v is not None}
            values.update(rule.set)
            self._set_state(state, values, line_no, rule.hint)
            if rule.progress:
                self._progress(state, line_no)
            elif rule.hint and state.hint_stage and state.hint_line == line_no:
                self._late_stage(state.hint_stage, prefix_attrs.get("rank"), line_no, f)
            if g.get("ts"):
                when = self.times.parse(g["ts"])
                if when:
                    state.last_time = when
            if rule.metrics:
                metrics_offset = f.base + start
                f.metrics.append(self._metric(rule, g, state, metrics_offset, when, prefix_attrs))
            if rule.facts:
                told = rule_facts(rule, g)
                if told:
                    f.facts.append(told)
        for rule in ev_rules:
            if not any(lit in text for lit in rule.literals):
                continue
            found = self._match(rule, text, end, f.chunk)
            if found is None:
                continue
            m, ms, matched, used_end = found
            ev = self._event(rule, m, ms, matched, raw, prefix_attrs, state, line_no, f, start)
            if rule.alone:
                f.events.append(ev)
            else:
                self._report(ev, rule.priority, state, line_no, f)
            if used_end > end:
                f.skip_to = used_end
            return

    def _match(
        self, rule: Rule, text: str, end: int, chunk: bytes
    ) -> tuple[Any, list[Any], str, int] | None:
        """Match one rule at a line; multi-line rules and hard-wrapped lines see what follows."""
        if rule.lines > 1:
            more = self._following(chunk, end, rule.lines - 1)
            joined = "\n".join([text, *(t for t, _ in more)])
            m = rule.cre.search(joined)
            if m is None or m.start() > len(text):
                return None
            used = joined.count("\n", 0, m.end())
            return m, [m], joined, more[used - 1][1] if used else end
        ms = list(rule.cre.finditer(text)) if rule.all_matches else []
        m = ms[0] if ms else (None if rule.all_matches else rule.cre.search(text))
        if len(text) >= WRAP_MIN and (m is None or m.end() >= len(text) - 40):
            more = self._following(chunk, end, 1)
            if more and not _NEW_RECORD.match(more[0][0]):
                joined = text + more[0][0]
                m2 = rule.cre.search(joined)
                if (
                    m2 is not None
                    and m2.start() < len(text) <= m2.end()
                    and (m is None or m2.end() > m.end())
                ):
                    ms2 = list(rule.cre.finditer(joined)) if rule.all_matches else [m2]
                    return m2, ms2, joined, more[0][1]
        if m is None:
            return None
        return m, ms or [m], text, end

    def _late_stage(self, stage: str, rank: Any, line_no: int, f: _Feed) -> None:
        """Frames printed after the report's first line (IPython): they name its stage too."""
        for idx in f.opened.values():
            ev = f.events[idx]
            near = ev.stage is None and line_no - (ev.line or 0) <= BLOCK_LINES
            if near and (rank is None or ev.rank is None or ev.rank == rank):
                f.events[idx] = dataclasses.replace(ev, stage=stage)

    def _event(
        self,
        rule: Rule,
        m: Any,
        ms: list[Any],
        text: str,
        raw: str,
        prefix_attrs: Mapping[str, Any],
        state: StreamState,
        line_no: int,
        f: _Feed,
        start: int,
    ) -> Event:
        g = {k: v for k, v in m.groupdict().items() if v is not None}
        attrs: dict[str, Any] = {}
        fields: dict[str, Any] = dict(rule.const)
        for k, v in [*rule.set.items(), *g.items()]:
            if k.startswith("_") or k in ("ts", "iters"):
                continue
            if k in _INT_ATTRS:
                try:
                    attrs[k] = int(v)
                except (TypeError, ValueError):
                    continue
            elif k == "stage":
                st = normalize_stage(str(v))
                if st:
                    attrs[k] = st
            elif k == "device":
                dev = _device(v)
                if dev:
                    attrs[k] = dev
            elif k == "node":
                attrs[k] = str(v)
            else:
                typ = rule.types.get(k) or FIELD_TYPES.get(k, "str")
                fields[k] = convert(v, typ) if isinstance(v, str) else v
        if isinstance(fields.get("backend"), str):
            fields["backend"] = fields["backend"].lower()
        code = fields.get("exit_code")
        if isinstance(code, int) and code < 0 and "signal" not in fields:
            try:
                fields["signal"] = _signal.Signals(-code).name
            except ValueError:
                pass
        if rule.all_matches and len(ms) > 1:
            for k in list(fields):
                vals = []
                for mm in ms:
                    val = mm.groupdict().get(k)
                    if val is not None and val not in vals:
                        vals.append(val)
                if len(vals) > 1:
                    fields[k + "s"] = vals
        when: str | None = None
        ts = g.get("ts")
        if ts:
            when = self.times.parse(ts)
        if when is None:
            when = self.times.parse(text) or (self.times.parse(raw) if raw != text else None)
        if when is not None:
            state.last_time = when
        elif state.last_time:
            # tracebacks rarely carry a time: remember the stream's last one for correlation
            fields["stream_time"] = state.last_time
        stage = attrs.get("stage")
        if stage is None and state.hint_stage and line_no - state.hint_line <= HINT_WINDOW:
            stage = state.hint_stage
            state.hint_stage = None
        if stage is None:
            stage = state.stage
        rank = prefix_attrs.get("rank", attrs.get("rank"))
        if rank is None and state.hint_rank is not None:
            rank = state.hint_rank if line_no - state.hint_rank_line <= RANK_HINT_WINDOW else None
        if rank is None:
            rank = state.rank
        local_rank = prefix_attrs.get("local_rank", attrs.get("local_rank", state.local_rank))
        if rank is None and local_rank is not None:
            rank = local_rank  # a local rank stands in when nothing names the global one
        message = text.strip()
        if rule.message:
            try:
                # the text as printed ("2.00 GiB", "NCCL") reads better than the typed value
                message = rule.message.format_map(_Missing({**fields, **g}))
            except (KeyError, IndexError, ValueError, AttributeError):
                message = text.strip()
        if len(message) > MESSAGE_MAX:
            message = message[:MESSAGE_MAX] + "…"
        device = attrs.get("device") or _device(prefix_attrs.get("device") or "") or state.device
        return Event(
            kind=str(rule.kind),
            message=message,
            offset=f.base + start,
            time=when,
            file=f.file,
            line=line_no,
            rank=rank,
            local_rank=local_rank,
            node=attrs.get("node", prefix_attrs.get("node", state.node)),
            epoch=attrs.get("epoch", state.epoch),
            iter=attrs.get("iter", state.iter),
            step=attrs.get("step", state.step),
            stage=stage,
            device=device,
            fields={"rule": rule.id, **fields},
        )

    # -- failure reports -------------------------------------------------------------------------

    def _report(self, ev: Event, prio: int, state: StreamState, line_no: int, f: _Feed) -> None:
        """Add ``ev`` to the events, or fold it into the open report it belongs to."""
        family = _FAMILY.get(ev.kind, ev.kind)
        blocks = state.blocks
        for k in [k for k, b in blocks.items() if line_no - b[1] > BLOCK_LINES]:
            del blocks[k]
            f.opened.pop(k, None)
        key = "?" if ev.rank is None else str(ev.rank)

        def usable(k: str) -> bool:
            b = blocks.get(k)
            return b is not None and b[0] == family and b[1] >= state.progress_line

        found: str | None = None
        if key != "?":
            found = key if usable(key) else ("?" if usable("?") else None)
        else:
            same = [k for k in blocks if usable(k)]
            if same:
                found = max(same, key=lambda k: blocks[k][1])
        if found is None:
            self._open(ev, prio, key, family, line_no, blocks, f)
            return
        b = blocks[found]
        if found in f.opened:
            idx = f.opened[found]
            # ties go to the later line: the final exception line of a traceback says most
            stronger = prio >= f.prios[idx]
            merged = _merge(f.events[idx], ev, stronger)
            f.events[idx] = merged
            if stronger:
                f.prios[idx] = prio
            new_key = "?" if merged.rank is None else str(merged.rank)
            blocks.pop(found)
            f.opened.pop(found)
            blocks[new_key] = [family, line_no, f.prios[idx], merged.kind]
            f.opened[new_key] = idx
        elif prio > b[2] and ev.kind != b[3]:
            # the report's first event was committed with an earlier chunk; a stronger line of
            # another kind (an error that turns out to be a timeout) still gets its own event
            blocks.pop(found)
            self._open(ev, prio, key, family, line_no, blocks, f)
        else:
            b[1] = line_no

    @staticmethod
    def _open(
        ev: Event,
        prio: int,
        key: str,
        family: str,
        line_no: int,
        blocks: dict[str, list[Any]],
        f: _Feed,
    ) -> None:
        f.events.append(ev)
        idx = len(f.events) - 1
        f.prios[idx] = prio
        f.opened[key] = idx
        blocks[key] = [family, line_no, prio, ev.kind]


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


class _Missing(dict[str, Any]):
    """Message templates name groups that some lines lack: say so."""

    def __missing__(self, key: str) -> str:
        return "unknown"


def _merge(old: Event, new: Event, stronger: bool) -> Event:
    """One report, two lines: keep the first line's place, fill what it did not say."""
    upd: dict[str, Any] = {}
    for a in _MERGED_ATTRS:
        if getattr(old, a) is None and getattr(new, a) is not None:
            upd[a] = getattr(new, a)
    fields = dict(old.fields)
    if stronger:
        upd["kind"] = new.kind
        upd["message"] = new.message
        fields.update(new.fields)
    else:
        for k, v in new.fields.items():
            fields.setdefault(k, v)
    upd["fields"] = fields
    return dataclasses.replace(old, **upd)
