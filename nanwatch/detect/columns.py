"""Iteration lines read as columns: a whole chunk of one known format in one regex pass.

A chunk rule with a ``columns`` head (parsers/mmengine.toml) declares what the start of its
lines looks like. Its rows regex is ``^`` + that head + the rule's pattern + the rest of the
line, run once over the chunk (``finditer``); its groups become columns (offset, line, stage,
epoch, iter, step, time, and every metric), and the stream state after the rows is the last
row's. What makes the result the line engine's, to the byte:

- the rows must be every line the rule's literals occur in: the number of rows is compared with
  the literals' count in the chunk, and any difference hands the chunk to the line engine (a
  wrapped line, a prefixed one, an unknown head, two markers on a line);
- a line longer than the rule examines, or one that starts with a known prefix (a rank tag), is
  not a row either, so it too sends its chunk to the line engine;
- rows that other rules want to read (an event literal on them: a NaN loss) are handed back to
  the line engine one by one, in their place among the rows (``engine.py``).

Where it is built, the compiled chunk core (``core.py``, ``_chunkcore.c``) finds the rows of
the shipped mmengine format and converts their numbers instead of ``finditer``; any chunk it
does not read exactly as the regex would is read here, which stays the reference.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import accumulate, repeat
from typing import Any, cast

from .._dc import dataclass
from ..events import Metric
from ..stream import StreamState
from . import core as _core
from .bounds import COUNT_LIMIT
from .bounds import count as _count
from .compiled import ChunkPlan, Compiled, _number
from .context import progressed
from .rules import Rule, normalize_stage
from .timestamps import TimeParser

# the stream-state keys a columns rule may set (others need the line engine's bookkeeping)
COLUMN_KEYS = frozenset(("stage", "epoch", "iter", "iters", "step"))


@dataclass
class MetricColumns:
    """One chunk's iteration rows as parallel lists, keyed like :class:`Metric` plus ``line``."""

    offset: list[int]
    line: list[int]
    rank: list[int | None]
    step: list[int | None]
    epoch: list[int | None]
    iter: list[int | None]
    stage: list[str | None]
    time: list[str | None]
    loss: list[float | None]
    grad_norm: list[float | None]
    step_time: list[float | None]
    data_time: list[float | None]
    lr: list[float | None]
    memory: list[float | None]

    def __len__(self) -> int:
        return len(self.offset)

    def rows(self) -> list[Metric]:
        """The rows as :class:`Metric` tuples (what ``Store.insert_metrics`` takes)."""
        fast = _core.zip_rows()
        if fast is not None:
            got = fast(Metric, tuple(getattr(self, f) for f in Metric._fields))
            if got is not None:
                return got
        return list(
            map(
                Metric._make,
                zip(
                    self.offset,
                    self.rank,
                    self.step,
                    self.epoch,
                    self.iter,
                    self.stage,
                    self.time,
                    self.loss,
                    self.grad_norm,
                    self.step_time,
                    self.data_time,
                    self.lr,
                    self.memory,
                ),
            )
        )


def joined(rows: list[Metric], segments: list[tuple[int, MetricColumns]]) -> tuple[list[Any], ...]:
    """One chunk's metrics as columns in :class:`Metric`'s field order: the line engine's
    ``rows`` with the column segments between them (each after the rows made before it), in
    the order :meth:`Detector.feed` returns them as rows."""
    fields = Metric._fields
    if not rows and len(segments) == 1:  # the usual chunk: one run of iteration lines
        return tuple(getattr(segments[0][1], name) for name in fields)
    out: tuple[list[Any], ...] = tuple([] for _ in fields)
    done = 0
    for at, seg in segments:
        if at > done:
            for col, vals in zip(out, zip(*rows[done:at])):
                col.extend(vals)
            done = at
        for col, name in zip(out, fields):
            col.extend(getattr(seg, name))
    if done < len(rows):
        for col, vals in zip(out, zip(*rows[done:])):
            col.extend(vals)
    return out


@dataclass
class Rows:
    """A chunk's rows: where each starts and its groups (bytes), in chunk order.

    The compiled core (``core.py``) gives ``cols`` instead of ``groups``: one list per group
    (by group index), numbers already converted as ``apply`` converts them, and ``lines``,
    the index of each row's line in the chunk, instead of ``ends`` (empty then).
    """

    starts: list[int]
    ends: list[int]  # where each row's line ends (its newline)
    groups: list[tuple[bytes | None, ...]]
    cols: list[list[Any]] | None = None
    lines: list[int] | None = None


class ColumnFormat:
    """A columns rule compiled for whole chunks: its rows regex and where its groups are."""

    def __init__(self, rule: Rule, index: int, prefixes: Sequence[str], c: Compiled) -> None:
        assert rule.columns is not None
        self.rule = rule
        self.index = index  # the rule's place among the chunk rules
        self.markers = tuple(lit.encode("utf-8") for lit in rule.literals)
        # literals only this rule uses: its rows need no prefilter
        self.own = {
            i
            for i, lit in enumerate(c.literals)
            if lit in self.markers and all(r is rule for r in c.users[lit.decode()])
        }
        self.inert = inert_literals(rule, self.markers, c)
        self.inert_ids = {c.literals.index(lit) for lit, _ in self.inert}
        # a line that starts with a prefix (a rank tag) is not a row: its chunk goes to the line
        # engine, which strips the prefix and takes the rank from it
        no_prefix = "(?!" + "|".join(f"(?:{p})" for p in prefixes) + ")" if prefixes else ""
        src = f"^{no_prefix}(?P<_head>{rule.columns}){rule.pattern}[^\\n]*".encode()
        try:
            self.cre: Any = re.compile(src, re.M)
        except re.error:
            import regex

            self.cre = regex.compile(src, regex.M | regex.V0)
        self.plan = ChunkPlan(rule, self.cre)
        gi = {name: i - 1 for name, i in self.cre.groupindex.items()}
        self.head = gi["_head"]
        self.date = gi.get("_date", -1)
        self.sec = gi.get("_sec", -1)
        self.keys = {k: (const, at) for k, const, at in self.plan.keys}
        self.max_bytes = rule.max_chars  # a longer line is examined in part: the line engine's
        # the compiled reader of this format, when there is one (core.py)
        self.core = _core.reader(rule.pattern, rule.columns, dict(self.cre.groupindex), prefixes)

    def parse(self, chunk: bytes, counts: dict[bytes, int] | None = None) -> Rows | None:
        """The chunk's rows, or None when they are not every line of the format (see above);
        ``counts``: how often each marker occurs in the chunk, when known."""
        if counts is None:
            counts = {m: chunk.count(m) for m in self.markers}
        expected = sum(counts.values())
        if self.core is not None:
            got = self._compiled(chunk, expected)
            if got is not None:
                return got
        ms = list(self.cre.finditer(chunk))
        if len(ms) != expected:
            return None
        limit = self.max_bytes
        spans = [m.span() for m in ms]
        if any(e - s > limit for s, e in spans):
            return None
        return Rows([s for s, _ in spans], [e for _, e in spans], [m.groups() for m in ms])

    def _compiled(self, chunk: bytes, expected: int) -> Rows | None:
        """The compiled core's rows; None when it leaves the chunk to the regex (it did not
        read every line as the regex does, or its rows are not every line of the format)."""
        assert self.core is not None
        fn, where = self.core
        got = fn(chunk, self.max_bytes)
        if got is None or len(got[0]) != expected:
            return None
        cols: list[list[Any]] = [[]] * self.cre.groups
        for at, col in zip(where, got[3:]):
            cols[at] = col
        return Rows(got[0], got[1], [], cols, got[2])


# what may stand before a marker in a line: a literal inside a marker is inert only when no
# such context makes a match start there
_CONTEXTS = ("", "\n", " ", "\t", "x", "X", "0", "_", ".", "-", "[", "(", ":", "E", "e", "I")


def _bordered(s: bytes) -> bool:
    """Can two occurrences of ``s`` overlap (a proper prefix that is also a suffix)?"""
    return any(s[:k] == s[-k:] for k in range(1, len(s)))


def _starts_with_literal(rule: Rule) -> bool:
    """Does every match of ``rule`` start with one of its literals (the pattern opens with one
    and has no top-level alternative)?"""
    from .bounds import _c, _readable, _sre

    try:
        tree = _sre.parse(_readable(rule.pattern))
    except Exception:  # regex-only syntax: not known
        return False
    if tree.state.flags & re.IGNORECASE:
        return False
    head = []
    for op, av in tree:
        if op != _c.LITERAL:
            break
        head.append(chr(av))
    text = "".join(head)
    return any(text.startswith(lit) for lit in rule.literals)


def inert_literals(rule: Rule, markers: Sequence[bytes], c: Compiled) -> list[tuple[bytes, bytes]]:
    """Literals of other rules that occur inside one of the columns rule's markers where no
    match of those rules can start ("poch" in "Epoch(": ``poch[:= ]`` needs no "(" next).

    A chunk in which every occurrence of such a literal is inside its marker (their counts are
    equal) sends no row to the line engine for it.
    """
    out: list[tuple[bytes, bytes]] = []
    for lit in c.literals:
        if lit in markers or _bordered(lit):
            continue
        hosts = [m for m in markers if lit in m]
        if len(hosts) != 1 or hosts[0].count(lit) != 1 or _bordered(hosts[0]):
            continue
        marker = hosts[0].decode()
        at = marker.index(lit.decode())
        users = [r for r in c.users[lit.decode()] if r is not rule]
        ok = bool(users)
        for r in users:
            if not _starts_with_literal(r):
                ok = False
                break
            for ctx in _CONTEXTS:
                text = ctx + marker
                if r.cre.match(text, len(ctx) + at, partial=True) is not None:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            out.append((lit, hosts[0]))
    return out


def _ints(col: Sequence[bytes | None]) -> list[int | None]:
    """int() of each \\d+ text; one beyond what a run counts (``bounds.count``) is missing."""
    try:
        out: list[int | None] = [int(b) for b in col]  # type: ignore[arg-type]
    except TypeError:
        out = [None if b is None else int(b) for b in col]
    if max(filter(None, out), default=0) >= COUNT_LIMIT:
        out = [_count(v) for v in out]
    return out


def _floats(col: Sequence[bytes | None], ms: bool) -> list[float | None]:
    """``metric_values`` of one column: float(text), else what ``_number`` reads, else None."""
    out: list[float | None]
    try:
        out = [float(b) for b in col]  # type: ignore[arg-type]
    except TypeError:
        try:
            out = [None if b is None else float(b) for b in col]
        except ValueError:
            out = []
    except ValueError:
        out = []
    if len(out) != len(col):
        out = []
        for b in col:
            if b is None:
                out.append(None)
                continue
            try:
                out.append(float(b))
            except ValueError:
                out.append(_number(b))
    if ms:
        out = [None if v is None else v / 1000.0 for v in out]
    return out


def _ffill(col: list[Any], first: Any) -> list[Any]:
    """Each value, or the last one before it when it is None (``first`` before the first)."""
    if None not in col:
        return col
    # (accumulate's ``initial=None`` means no initial value: the first one is prepended)
    return list(accumulate([first, *col], lambda a, b: a if b is None else b))[1:]


def apply(
    fmt: ColumnFormat,
    rows: Rows,
    lo: int,
    hi: int,
    state: StreamState,
    chunk: bytes,
    line_no: int,
    pos: int,
    base: int,
    tp: TimeParser,
) -> tuple[MetricColumns, int, int, tuple[int, int] | None]:
    """Rows ``lo:hi`` applied to ``state`` as the line engine applies them one by one.

    Returns their columns, the line count and position after the last row, and the (line,
    epoch) of the first row that named an epoch when the stream had named none before.
    ``tp`` is the engine's timestamp reader: a row's ``_date`` and ``_sec`` go through its
    per-minute cache, any other head through ``parse_bytes`` as the line engine reads it.
    """
    starts = rows.starts[lo:hi]
    count = chunk.count
    typed = rows.cols is not None  # the compiled core's: numbers converted already
    if rows.cols is not None and rows.lines is not None:
        cols: list[Sequence[Any]] = [c[lo:hi] for c in rows.cols]
        # line numbers: the newlines from pos to the first row, then the core's line indexes
        idx = rows.lines
        first_line = line_no + count(b"\n", pos, starts[0]) + 1 - idx[lo]
        lines = [first_line + i for i in idx[lo:hi]]
        end_line = lines[-1] - 1
    else:
        groups = rows.groups[lo:hi]
        cols = list(zip(*groups))
        # line numbers: newlines before each row, counted from the previous one (one when the
        # row starts right after the previous row's newline)
        ends = rows.ends[lo:hi]
        prev_starts = [pos, *starts[:-1]]
        prev_ends = [-2, *ends[:-1]]
        gaps = [
            1 if s == e + 1 else count(b"\n", a, s)
            for a, e, s in zip(prev_starts, prev_ends, starts)
        ]
        lines = [n + 1 for n in accumulate(gaps, initial=line_no)][1:]
        end_line = line_no + sum(gaps)
    n = len(starts)
    keys = fmt.keys

    def state_col(key: str) -> list[Any] | None:
        spec = keys.get(key)
        if spec is None:
            return None
        const, at = spec
        if const is not None:
            return [const] * n
        return list(cols[at])

    # stage: normalised per distinct bytes; a row without one keeps the stream's
    stages_raw = state_col("stage")
    stage_changed = False
    if stages_raw is not None:
        cache = fmt.plan.stages
        table: dict[Any, str | None] = {None: None}
        for b in set(stages_raw) - {None}:  # a handful of distinct values
            st = cache.get(b, "")
            if st == "":
                if len(cache) > 64:
                    cache.clear()
                st = cache[b] = normalize_stage(
                    b.decode("utf-8", "replace") if isinstance(b, bytes) else str(b)
                )
            table[b] = st or None
        norm: list[str | None] = list(map(table.__getitem__, stages_raw))
        stages = _ffill(norm, state.stage)
        stage_changed = stages.count(state.stage) != len(stages)
    else:
        stages = [state.stage] * n

    def int_col(key: str, current: int | None) -> tuple[list[int | None], list[bool]]:
        raw = state_col(key)
        if raw is None:
            return [current] * n, [False] * n
        vals = raw if typed and keys[key][0] is None else _ints(raw)
        given = [v is not None for v in vals]
        return _ffill(vals, current), given

    epochs, _ = int_col("epoch", state.epoch)
    iters_in, _ = int_col("iter", state.iter)
    per_epoch, _ = int_col("iters", state.iters)
    step_raw, step_given = int_col("step", state.step)

    # follow_step, row by row: the global step of epoch-based loops
    first0 = state.first_epoch == 0
    steps: list[int | None]
    if (
        not first0
        and not any(step_given)
        and None not in epochs
        and None not in iters_in
        and None not in per_epoch
        and 0 not in epochs
        and 0 not in per_epoch
        and stages.count("train") == n
    ):
        # the common case at once: training rows of an epoch-based loop counted from 1
        steps = [(e - 1) * p + i for e, i, p in zip(epochs, iters_in, per_epoch)]  # type: ignore[operator]
        if steps and max(steps) >= COUNT_LIMIT:  # type: ignore[operator,type-var]
            steps = [_count(s) for s in steps]
    else:
        steps = []
        step = state.step
        for e, it, per, st, given, s_raw in zip(
            epochs, iters_in, per_epoch, stages, step_given, step_raw
        ):
            if given:
                step = s_raw
            if e == 0:
                first0 = True
            if not given and st in (None, "train"):
                if e is not None and it is not None and per:
                    step = _count(max(e if first0 else e - 1, 0) * per + it)
                elif it is not None and e is None:
                    step = it
            steps.append(step)

    # times: the _date/_sec groups through the per-minute cache, else the line's head
    times: list[str | None] = []
    fast = _typed_times(cols[fmt.date], cols[fmt.sec], tp) if typed and fmt.date >= 0 else None
    if fast is not None:
        times = fast
    elif fmt.date >= 0:
        dates, secs, heads = cols[fmt.date], cols[fmt.sec], cols[fmt.head]
        whole = _WHOLE
        minute = tp.minute
        last: bytes | None = None
        at: float | bool = False
        prefix: str | None = None
        for d, s, h in zip(dates, secs, heads):
            if d is None or s is None:
                times.append(tp.parse_bytes(h[:80]))
                continue
            if d != last:  # the rows of one minute share its look-up
                at, prefix = minute(d)
                last = d
            sec = int(s)
            if at is False or sec >= 62:
                times.append(None)
            elif prefix is not None and sec < 60:
                times.append(prefix + whole[sec])
            else:
                times.append(tp.utc(float(at) + sec))
    else:
        times = [tp.parse_bytes(h[:80]) for h in cols[fmt.head]]

    specs = fmt.plan.metrics or ()
    names = Metric._fields[7:]
    values: dict[str, list[float | None]] = {}
    for name, spec in zip(names, specs):
        if spec is None:
            values[name] = [None] * n
        elif typed:
            col = list(cols[spec[0]])
            values[name] = [None if v is None else v / 1000.0 for v in col] if spec[1] else col
        else:
            values[name] = _floats(cols[spec[0]], spec[1])
    for name in names:
        values.setdefault(name, [None] * n)

    # the state after the rows: the last row's
    first_epoch: tuple[int, int] | None = None
    if state.epoch is None:
        for ln, e in zip(lines, epochs):
            if e is not None:
                first_epoch = (ln, e)
                break
    if n:
        if stage_changed:
            state.hint_stage = None
        state.stage = stages[-1]
        state.epoch = epochs[-1]
        state.iter = iters_in[-1]
        state.iters = per_epoch[-1]
        state.step = steps[-1]
        if first0:
            state.first_epoch = 0
        if fmt.rule.progress:
            progressed(state, lines[-1])  # as the line engine does after a progress line
        for t in reversed(times):
            if t:
                state.last_time = t
                break
    columns = MetricColumns(
        offset=[base + s for s in starts],
        line=lines,
        rank=list(repeat(state.rank, n)),
        step=steps,
        epoch=epochs,
        iter=iters_in,
        stage=stages,
        time=times,
        loss=values["loss"],
        grad_norm=values["grad_norm"],
        step_time=values["step_time"],
        data_time=values["data_time"],
        lr=values["lr"],
        memory=values["memory"],
    )
    end_pos = starts[-1] if n else pos
    return columns, end_line, end_pos, first_epoch


def _typed_times(
    dates: Sequence[bytes | None], secs: Sequence[int | None], tp: TimeParser
) -> list[str | None] | None:
    """The compiled core's rows' times when every row has a date on a UTC minute and a whole
    second below 60 (each minute looked up once, as the row-by-row loop does); else None."""
    if not secs or None in dates or None in secs:
        return None
    known = cast("Sequence[bytes]", dates)
    seconds = cast("Sequence[int]", secs)
    if max(seconds) >= 60:
        return None
    prefixes: dict[bytes, str] = {}
    for d in dict.fromkeys(known):  # distinct minutes, in row order
        at, prefix = tp.minute(d)
        if at is False or prefix is None:
            return None
        prefixes[d] = prefix
    whole = _WHOLE
    return [prefixes[d] + whole[s] for d, s in zip(known, seconds)]


_WHOLE = tuple(f"{s:02d}.000Z" for s in range(60))
