"""A rule set compiled for the hot path: one literal prefilter over whole chunks finds the lines
worth a look, and each chunk rule (an iteration line that occurs on every step) gets a plan
worked out once: its state keys, metric groups and Metric field order."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..events import Metric
from ..stream import StreamState
from . import core as _core
from . import prefilter
from .bounds import count
from .prefilter import Prefilter
from .rules import TIERS, Rule, RuleSet, normalize_stage

if TYPE_CHECKING:
    from .columns import ColumnFormat

_NAMED = re.compile(r"\(\?P<\w+>")
# stream state a context rule may set, in the order ``context.set_state`` applies them
STATE_KEYS = ("stage", "epoch", "iter", "iters", "step", "rank", "local_rank", "node", "device")
STATE_INTS = frozenset(("epoch", "iter", "iters", "step", "rank", "local_rank"))


class Compiled:
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
        users: dict[str, list[Rule]] = {}
        for r in rules.rules:
            for lit in dict.fromkeys(r.literals):
                users.setdefault(lit, []).append(r)
        self.users = users  # literal -> the rules that name it
        chunk_at = {id(r): i for i, r in enumerate(self.chunk_rules)}
        # literal index -> (does a line rule use it, the chunk rules that use it)
        self.lit_line = [any(not r.chunk for r in users[lit.decode()]) for lit in lits]
        self.lit_chunk = [
            frozenset(chunk_at[id(r)] for r in users[lit.decode()] if r.chunk) for lit in lits
        ]
        # worked out when a line first needs them (a start that reads nothing needs none)
        self.chunk_plans: list[ChunkPlan | None] = [None] * len(self.chunk_rules)
        # literals further into a line than any rule examines tell nothing: skipped cheaply
        self.cap = max((r.max_chars for r in rules.rules), default=0)
        self._union: dict[tuple[frozenset[int], frozenset[int]], frozenset[int]] = {}
        self._plans: dict[frozenset[int], tuple[ChunkPlan, ...]] = {}
        self._automaton = automaton
        self._single: dict[int, frozenset[int]] = {}
        # prefilters are built on first use (a start that reads nothing builds none): the whole
        # literal set, and per columns format the literals its rows do not need (columns.py)
        self._filters: dict[tuple[int, bool], tuple[Prefilter, list[int]]] = {}
        self._formats: list[ColumnFormat] | None = None
        self._needles: tuple[bytes, ...] | None = None  # what ``_count`` counts in a chunk
        self._counted: tuple[bytes, dict[bytes, int]] | None = None  # the last chunk's counts
        self.context_rules = [r for r in self.line_rules if r.type == "context"]
        # first match wins: most specific tier first, load order (site packs first) within one
        self.event_rules = sorted(
            (r for r in self.line_rules if r.type == "event"), key=lambda r: TIERS.index(r.tier)
        )
        # the rule tried first also names a failure report it shares with others (reports.py)
        n = len(self.event_rules)
        self.strength = {r.id: n - i for i, r in enumerate(self.event_rules)}
        # literal index -> positions of the rules that use it (a line only tries those)
        ctx_at = {id(r): i for i, r in enumerate(self.context_rules)}
        ev_at = {id(r): i for i, r in enumerate(self.event_rules)}
        self.lit_ctx = [
            tuple(sorted(ctx_at[id(r)] for r in users[lit.decode()] if id(r) in ctx_at))
            for lit in lits
        ]
        self.lit_ev = [
            tuple(sorted(ev_at[id(r)] for r in users[lit.decode()] if id(r) in ev_at))
            for lit in lits
        ]
        self._any_prefix: Any = False  # built when a first chunk is read
        self._any_prefix_text: Any = False

    @property
    def any_prefix(self) -> Any:
        """One cheap bytes check that tells whether a chunk-rule line carries a prefix at all
        (None: no rule has one)."""
        if self._any_prefix is False:
            self._any_prefix = None
            alts = self._prefix_alternation()
            if alts is not None:
                raw = alts.encode("utf-8")
                try:
                    self._any_prefix = re.compile(raw)
                except re.error:
                    import regex

                    self._any_prefix = regex.compile(raw, regex.V0)
        return self._any_prefix

    @property
    def any_prefix_text(self) -> Any:
        """:attr:`any_prefix` for a decoded line (None: no rule has a prefix)."""
        if self._any_prefix_text is False:
            self._any_prefix_text = None
            alts = self._prefix_alternation()
            if alts is not None:
                import regex

                self._any_prefix_text = regex.compile(alts, regex.V0)
        return self._any_prefix_text

    def _prefix_alternation(self) -> str | None:
        """Every prefix pattern, unanchored and without group names, as one alternation."""
        alts = [_NAMED.sub("(?:", p.pattern.lstrip("^")) for p in self.rules.prefixes]
        return "(?:" + "|".join(f"(?:{a})" for a in alts) + ")" if alts else None

    def literal_filter(self, fmt: int | None = None, inert: bool = False) -> tuple[Any, list[int]]:
        """The literal prefilter (and its literals' indexes in ``literals``): of every literal,
        or (``fmt``: a columns format's index) of those its rows do not make redundant."""
        key = (-1 if fmt is None else fmt, inert)
        got = self._filters.get(key)
        if got is None:
            keep = list(range(len(self.literals)))
            if fmt is not None:
                drop = self.formats[fmt].own | (self.formats[fmt].inert_ids if inert else set())
                keep = [i for i in keep if i not in drop]
            backend = None if self._automaton else "regex"
            if fmt is None and backend is None and prefilter.backend_name() == "hyperscan":
                # every iteration line holds one of these: hyperscan's per-match callback into
                # Python costs more than Aho-Corasick's list of matches built in Rust
                backend = "ahocorasick"
            got = self._filters[key] = (
                Prefilter([self.literals[i] for i in keep], backend),
                keep,
            )
        return got

    def _found(
        self, chunk: bytes, fmt: int | None = None, counts: dict[bytes, int] | None = None
    ) -> list[tuple[int, int, int]]:
        """(literal index, start, end) of every literal occurrence, overlapping ones included;
        with ``fmt``, of the literals that the columns format's rows leave to the line engine
        (``counts``: its markers' occurrences in the chunk)."""
        inert = False
        if fmt is not None:
            # an inert literal drops out only when each of its occurrences is inside a marker
            f = self.formats[fmt]
            known = dict(counts or {})
            if self._counted is not None and self._counted[0] is chunk:
                known.update(self._counted[1])  # counted with the markers, in the same pass
            inert = all(
                (known[lit] if lit in known else chunk.count(lit))
                == (known[m] if m in known else chunk.count(m))
                for lit, m in f.inert
            )
        pf, keep = self.literal_filter(fmt, inert)
        found: list[tuple[int, int, int]] = pf.find(chunk)
        if fmt is None:
            return found
        return [(keep[i], s, e) for i, s, e in found]

    def lines(
        self, chunk: bytes, fmt: int | None = None, counts: dict[bytes, int] | None = None
    ) -> dict[int, list[Any]]:
        """The lines worth a look: start -> [end, literals of line rules it holds (or None),
        the chunk rules whose literals it holds (or None)]; ``fmt``: a columns format reads
        its own rows (they are here only when other rules' literals occur in them)."""
        out: dict[int, list[Any]] = {}
        lit_line, lit_chunk, union = self.lit_line, self.lit_chunk, self._union
        line_start = line_end = skip = limit = -1
        entry: list[Any] = []
        for idx, s, _ in self._found(chunk, fmt, counts):
            if s < skip:
                continue  # past what any rule examines of a long line (bounds.py)
            if not line_start <= s < line_end:
                line_start = chunk.rfind(b"\n", 0, s) + 1
                line_end = chunk.find(b"\n", s)
                if line_end < 0:
                    line_end = len(chunk)
                got = out.get(line_start)
                if got is None:
                    got = out[line_start] = [line_end, None, None]
                entry = got
                limit = line_start + 4 * self.cap  # a character is at most 4 bytes
            if s >= limit:
                skip = line_end
                continue
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

    @property
    def formats(self) -> list[ColumnFormat]:
        """The columns formats (columns.py), worked out when the first chunk is read."""
        if self._formats is None:
            from .columns import ColumnFormat  # columns builds on this module's plans

            self._formats = [
                ColumnFormat(r, i, self.prefix_sources(), self)
                for i, r in enumerate(self.chunk_rules)
                if r.columns is not None
            ]
        return self._formats

    def prefix_sources(self) -> list[str]:
        """The prefix patterns without their anchor and group names (one bytes check)."""
        return [_NAMED.sub("(?:", p.pattern.lstrip("^")) for p in self.rules.prefixes]

    def format_for(self, chunk: bytes) -> tuple[int, dict[bytes, int]] | None:
        """The columns format whose rows this chunk holds and how often each of its markers
        occurs (None: no format's, or more than one format's)."""
        if not self.formats:
            return None
        counted = self._count(chunk)
        found = None
        for i, f in enumerate(self.formats):
            counts = {m: counted[m] for m in f.markers}
            if any(counts.values()):
                if found is not None:
                    return None
                found = (i, counts)
        return found

    def _count(self, chunk: bytes) -> dict[bytes, int]:
        """How often every format's markers and inert literals occur in ``chunk``, counted in
        one pass (the compiled core's) and kept for the chunk's prefilter (``_found``)."""
        needles = self._needles
        if needles is None:
            seen: dict[bytes, None] = {}
            for f in self.formats:
                seen.update(dict.fromkeys(f.markers))
                seen.update(dict.fromkeys(lit for lit, _ in f.inert))
            needles = self._needles = tuple(seen)
        counted = dict(zip(needles, _core.count_all(chunk, needles)))
        self._counted = (chunk, counted)
        return counted

    def with_rule(self, rules: frozenset[int] | None, index: int) -> frozenset[int]:
        """``rules`` and the chunk rule ``index`` (the sets are shared: kept, never mutated)."""
        one = self._single.get(index)
        if one is None:
            one = self._single[index] = frozenset((index,))
        if rules is None or rules == one:
            return one
        both = self._union.get((rules, one))
        if both is None:
            both = self._union[(rules, one)] = rules | one
        return both

    def plans(self, rules: frozenset[int]) -> tuple[ChunkPlan, ...]:
        """The chunk rules of a set of indexes, in rule order."""
        got = self._plans.get(rules)
        if got is None:
            got = self._plans[rules] = tuple(self._plan(i) for i in sorted(rules))
        return got

    def _plan(self, i: int) -> ChunkPlan:
        plan = self.chunk_plans[i]
        if plan is None:
            plan = self.chunk_plans[i] = ChunkPlan(self.chunk_rules[i])
        return plan


class ChunkPlan:
    """What applying one chunk rule to a match needs, worked out once per rule.

    A chunk rule fires on every iteration line of a run (hundreds of thousands in a catch-up
    scan), so its state keys, metric groups and Metric field order are resolved here.
    """

    __slots__ = ("cre", "keys", "metrics", "rule", "stages", "ts")

    def __init__(self, rule: Rule, cre: Any = None) -> None:
        assert rule.chunk_cre is not None
        cre = rule.chunk_cre if cre is None else cre  # a columns format's rows regex
        names = set(cre.groupindex)
        self.rule = rule
        self.cre = cre
        index = {name: i - 1 for name, i in cre.groupindex.items()}  # in groups()
        # (state key, the rule's constant for it or None, the group's place in groups())
        self.keys = tuple(
            (k, rule.set.get(k), index.get(k, -1))
            for k in STATE_KEYS
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


def metric_values(
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


def chunk_state(plan: ChunkPlan, g: tuple[bytes | None, ...], state: StreamState) -> None:
    """``context.set_state`` (not a hint) for a chunk rule's match, limited to the keys it has."""
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
            if key in STATE_INTS:
                if key == "step":
                    step_given = True
                n = count(b)
                if n is not None or b.isdigit():  # beyond what a run counts: not a position
                    if n is not None:
                        setattr(state, key, n)
                    continue
                # not ASCII digits: what the decoded text says
            v = b.decode("utf-8", "replace")
        if key == "stage":
            stage = normalize_stage(str(v))
            if stage:
                if stage != state.stage:
                    state.hint_stage = None
                state.stage = stage
        elif key in STATE_INTS:
            if key == "step":
                step_given = True
            n = count(v) if v != "" else None
            if n is not None:
                setattr(state, key, n)
        elif v:
            setattr(state, key, str(v))
    state.follow_step(step_given)
