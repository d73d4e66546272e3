"""The detection engine: chunks of complete lines in, events and metrics out.

The hot path works on whole chunks of bytes: chunk rules (iteration lines that occur on every
step) run with one ``finditer`` over the chunk, and one literal prefilter finds the few other
lines worth a closer look. Lines that match neither cost nothing but a newline count.

The ``Detector`` feeds chunks, strips line prefixes and runs the line engine (context rules,
then event rules, on each candidate line). What it uses, in order along a line:

- ``compiled``: the compiled rule set (prefilter, chunk plans); ``columns``: iteration lines
  read as columns;
- ``lines``: a line's text (decoding, prefixes and what they carry, hard-wrapped tails);
- ``context``: what context rules tell the stream state; ``ranks``: who printed a line and
  which rank it is; ``records``: tracebacks and other records a line opens;
- ``build``: the event a rule's match gives; ``cascade``: overflow notices that become an
  incident; ``reports``: detections of one failure report (a traceback, an HCCL error block)
  as one event.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..events import Event, Metric
from ..sources.dates import file_bound
from ..stream import StreamState
from . import companion, progress, ranks
from .bounds import LONG_LINE, MATCH_BUDGET
from .build import build_event, risen
from .cascade import cascade, logged_since
from .columns import ColumnFormat, MetricColumns, Rows, joined
from .columns import apply as apply_rows
from .compiled import ChunkPlan, Compiled, chunk_state, metric_values
from .context import late_stage, progressed, set_state
from .facts import rule_facts
from .lines import WRAP_MIN, decode_line, starts_record, strip_prefixes, wrapped_head
from .records import close_record, ended_inside, in_record, open_record
from .reports import BLOCK_LINES, Feed, report
from .rules import Rule, RuleSet
from .timestamps import TimeParser

log = logging.getLogger("nanwatch.detect")

AHEAD_MAX = 256  # reports per chunk that may look at the lines after them for their step
MEMORY_PRIORITY = 0  # a companion memory summary never outranks a rule's detection (all > 0)


class Detector:
    """Applies a RuleSet to streams. Stateless itself: each stream passes its StreamState."""

    def __init__(
        self,
        rules: RuleSet,
        *,
        default_year: int | None = None,
        automaton: bool = True,
        columns: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._compiled: Compiled | None = None  # built for the first chunk (see ``_c``)
        self._automaton = automaton
        # whole chunks of a known iteration-line format read as columns (columns.py); off: the
        # line engine reads every line (the reference the column reader is tested against)
        self.columns = os.environ.get("NANWATCH_COLUMNS") != "0" if columns is None else columns
        self.rules = rules
        self.times = TimeParser(default_year)
        # lines_capped: lines longer than what a rule examines; rule_timeouts: matches that ran
        # out of their time budget (see bounds.py)
        self.counters: Counter[str] = Counter()
        self._cap = min((r.max_chars for r in rules.rules), default=0)
        self._warned: set[str] = set()
        self._ahead = frozenset(r.id for r in rules.rules if r.ahead)
        self._clock = clock  # the bound of a year-less line's date when the bytes have no file

    @property
    def _c(self) -> Compiled:
        """The rule set compiled for the hot path; a start that reads no text builds none."""
        c = self._compiled
        if c is None:
            c = self._compiled = Compiled(self.rules, automaton=self._automaton)
        return c

    # -- public ----------------------------------------------------------------------------------

    def ended(self, state: StreamState, file: str | None = None) -> list[Event]:
        """What the end of a stream's text says (a scan read it to its end): a traceback it
        ends inside is a failure of the process that printed it (``records.py``)."""
        return ended_inside(state, file)

    def feed(
        self,
        chunk: bytes,
        base_offset: int,
        state: StreamState,
        file: str | None = None,
        *,
        facts: list[dict[str, Any]] | None = None,
        trace: set[str] | None = None,
    ) -> tuple[list[Event], list[Metric]]:
        """Process ``chunk`` (complete lines only) that starts at byte ``base_offset``.

        Updates ``state`` in place (line count, context) and returns what the lines yield.
        Run facts the lines tell (versions, world size, timeouts...) are appended to ``facts``
        when it is given; the ids of the prefixes and rules that matched a line are added to
        ``trace`` (the examples runner: an example must pass through its own rule).
        """
        f = self._feed(chunk, base_offset, state, file, facts, trace, None)
        return f.events, f.metrics

    def feed_columns(
        self,
        chunk: bytes,
        base_offset: int,
        state: StreamState,
        file: str | None = None,
        *,
        facts: list[dict[str, Any]] | None = None,
    ) -> tuple[list[Event], tuple[list[Any], ...]]:
        """:meth:`feed`, with the metrics as columns in :class:`Metric`'s field order (one list
        per field): the rows read as columns stay columns, no tuple is made per iteration."""
        segments: list[tuple[int, MetricColumns]] = []
        f = self._feed(chunk, base_offset, state, file, facts, None, segments)
        return f.events, joined(f.metrics, segments)

    def _feed(
        self,
        chunk: bytes,
        base_offset: int,
        state: StreamState,
        file: str | None,
        facts: list[dict[str, Any]] | None,
        trace: set[str] | None,
        segments: list[tuple[int, MetricColumns]] | None,
    ) -> Feed:
        c = self._c
        # year-less timestamps: not after the file was last written, not before the stream's
        # previous dated line
        self.times.begin(file_bound(file, self._clock), state.last_time)
        got = c.format_for(chunk) if self.columns and c.formats else None
        rows: Rows | None = None
        fi: int | None = None
        counts: dict[bytes, int] | None = None
        if got is not None:
            fi, counts = got
            rows = c.formats[fi].parse(chunk, counts)
            if rows is None:
                fi = None  # not every line of the format is a row: the line engine reads it
                self.counters["column_fallbacks"] += 1
        lines = c.lines(chunk, fi, counts)
        # the in-process companion's records (one cheap search; most chunks have none)
        records = companion.line_starts(chunk) if companion.PREFIX in chunk else set()
        f = Feed(chunk, base_offset, file)
        if not lines and not records and not (rows and rows.starts):
            state.line_no += chunk.count(b"\n")
            return f
        # the pipeline hands shallow copies of a state around: never mutate a shared dict
        state.blocks = {k: list(v) for k, v in state.blocks.items()}
        f.trace = trace
        f.segments = segments
        any_prefix = c.any_prefix
        line_no = state.line_no
        pos = 0
        fmt = c.formats[fi] if fi is not None and rows is not None else None
        starts = rows.starts if rows is not None else []
        k, nrows = 0, len(starts)
        for start in sorted(lines.keys() | records if records else lines):
            if k < nrows and starts[k] <= start:
                # the rows before this line, all at once; a row that other rules want to read
                # too goes through the line engine here, with its own rule among its chunk rules
                assert fmt is not None and rows is not None
                hi = bisect.bisect_left(starts, start, k)
                if hi > k:
                    line_no, pos = self._rows(fmt, rows, k, hi, state, line_no, pos, f)
                k = hi
                if k < nrows and starts[k] == start:
                    entry = lines[start]
                    entry[2] = c.with_rule(entry[2], fmt.index)
                    k += 1
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
            hits: list[tuple[ChunkPlan, Any]] | None = None
            if rules is not None:
                for plan in c.plans(rules):
                    m = plan.cre.search(chunk, start, min(end, start + plan.rule.max_chars))
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
                text, prefix_attrs = self._strip_prefixes(raw, f.trace)
                if state.pid_ranks and "rank" not in prefix_attrs and "pid" in prefix_attrs:
                    # an actor's line without a rank: the rank another line of that process named
                    rank = state.pid_ranks.get(prefix_attrs["pid"])
                    if rank is not None:
                        prefix_attrs["rank"] = rank
                if not prefix_attrs and raw == text and start > 0:
                    prefix_attrs = self._wrapped_from(chunk, start, raw)
            if hits is not None:
                for plan, m in hits:
                    if f.trace is not None:
                        f.trace.add(plan.rule.id)
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
        if k < nrows:
            assert fmt is not None and rows is not None
            line_no, pos = self._rows(fmt, rows, k, nrows, state, line_no, pos, f)
        state.line_no = line_no + chunk.count(b"\n", pos)  # the lines before pos are counted
        if facts is not None:
            facts.extend(f.facts)
        # a report with no counters at all, just before a logged step (or a bar redrawn after
        # it): that step's
        looked = 0
        for i, e in enumerate(f.events):
            counted = e.epoch is not None or e.iter is not None or e.step is not None
            if counted and e.fields.get("rule") not in self._ahead:
                continue
            if looked >= AHEAD_MAX or e.offset is None or not 0 <= e.offset - f.base < len(chunk):
                break
            looked += 1
            nxt = progress.after(chunk, e.offset - f.base)
            if nxt is not None:
                f.events[i] = dataclasses.replace(
                    e,
                    epoch=e.epoch if nxt.epoch is None else nxt.epoch,
                    iter=nxt.iter,
                    step=nxt.step,
                    stage=e.stage or nxt.stage,
                    # the step's line right after the report names the rank that printed both
                    rank=e.rank if e.rank is not None else nxt.rank,
                )
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
        # no stage unless the text names one (a progress line, a traceback frame, the entry
        # script): an inference server or an evaluation script is not training
        return f

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
                m = self._search(r, stripped)
                if m:
                    vals = {k: v for k, v in m.groupdict().items() if v is not None}
                    matches.append(
                        {
                            "rule": r.id,
                            "type": "hint" if r.hint else r.type,
                            "kind": r.kind,
                            "pack": r.pack,
                            "tier": r.tier,
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

    def _rows(
        self,
        fmt: ColumnFormat,
        rows: Rows,
        lo: int,
        hi: int,
        state: StreamState,
        line_no: int,
        pos: int,
        f: Feed,
    ) -> tuple[int, int]:
        """Rows ``lo:hi`` of a columns format, applied at once (columns.py)."""
        cols, line_no, pos, first = apply_rows(
            fmt, rows, lo, hi, state, f.chunk, line_no, pos, f.base, self.times
        )
        if fmt.plan.metrics is not None:
            if f.segments is not None:
                f.segments.append((len(f.metrics), cols))  # between the rows made before it
            else:
                f.metrics.extend(cols.rows())
        self.counters["column_rows"] += hi - lo
        if first is not None and f.first_epoch is None:
            f.first_epoch = first
        if f.trace is not None:
            f.trace.add(fmt.rule.id)
        return line_no, pos

    def _wrapped_from(self, chunk: bytes, start: int, line: str) -> dict[str, Any]:
        """The prefix attributes of the line before ``start`` when ``line`` (which has no
        prefix) is its hard-wrapped tail (``lines.wrapped_head``)."""
        prev = wrapped_head(chunk, start, line)
        return {} if prev is None else self._strip_prefixes(prev)[1]

    def prefix_attrs(self, line: str) -> dict[str, Any]:
        """The attributes (rank, node...) the prefixes of ``line`` carry."""
        return self._strip_prefixes(decode_line(line.encode("utf-8")))[1]

    def _strip_prefixes(
        self, text: str, trace: set[str] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """``text`` without its prefixes, and what they carry (``lines.strip_prefixes``)."""
        return strip_prefixes(text, self.rules.prefixes, self._c.any_prefix_text, trace)

    def _record(self, raw: bytes, state: StreamState, line_no: int, start: int, f: Feed) -> None:
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
                ranks.announced(state, rank)
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
                report(ev, MEMORY_PRIORITY, state, line_no, f)

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

    def _apply_chunk_rule(
        self,
        plan: ChunkPlan,
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
            set_state(state, values, line_no, True, rule.entry)
        else:
            chunk_state(plan, g, state)
        if rule.progress:
            progressed(state, line_no)
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
                        *metric_values(g, plan.metrics),
                    )
                )
            )

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
        f: Feed,
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
        if len(text) > self._cap:
            self._capped(len(text), line_no, f.file)
        ctx_text = text
        if "\r" in text:
            # a progress bar redrawn with \r: its context is the last update; event patterns
            # never cross from one update to the next
            parts = [p for p in text.split("\r") if p.strip()]
            ctx_text = parts[-1] if parts else ""
            text = text.replace("\r", "\n")
        # a literal counts only inside what the pattern examines: a megabyte line is not
        # searched whole for each literal of each rule
        long = len(text) > self._cap
        cut: dict[int, str] = {}
        for rule in ctx_rules:
            probe = _window(ctx_text, rule.max_chars, cut) if long else ctx_text
            if not any(lit in probe for lit in rule.literals):
                continue
            m = self._search(rule, ctx_text)
            if m is None:
                continue
            if f.trace is not None:
                f.trace.add(rule.id)
            g = m.groupdict()
            values: dict[str, Any] = {k: v for k, v in g.items() if v is not None}
            values.update(rule.set)
            if rule.hint and "rank" in values and ranks.same_process(state, ctx_text, line_no):
                # one process, one rank: the process named its rank ("RankID:101") in its
                # report's head; another rank in its later lines is a group's or a peer's
                # ("group information: [..., rankSize[32], rankId[25 24]]")
                del values["rank"]
            set_state(state, values, line_no, rule.hint, rule.entry)
            if values.get("stage") is not None:
                if rule.hint:
                    if state.hint_line == line_no:
                        state.hint_stage_rank = prefix_attrs.get("rank")
                else:
                    state.stage_rank = None if rule.progress else prefix_attrs.get("rank")
            if rule.hint:
                if values.get("rank") is not None:
                    state.hint_rank_pid = ranks.reporter_pid(ctx_text)
                ranks.record_rank(state, values, prefix_attrs, line_no)
                if text[:1].isspace() and "rank" not in prefix_attrs:
                    ranks.late_rank(values.get("rank"), line_no, f, state)
            if rule.opens is not None:
                open_record(
                    state, rule.opens, prefix_attrs.get("rank"), line_no, f.base + start, text
                )
            if rule.progress:
                progressed(state, line_no)
            elif rule.hint and state.hint_stage and state.hint_line == line_no:
                # every rank runs the entry script: its frame speaks for all of them
                rank = None if rule.entry else prefix_attrs.get("rank")
                late_stage(state.hint_stage, rank, line_no, f, rule.entry)
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
        cut = {}
        for rule in ev_rules:
            probe = _window(text, rule.max_chars, cut) if long else text
            if not any(lit in probe for lit in rule.literals):
                continue
            rank = prefix_attrs.get("rank")
            if rule.within is not None and not in_record(state, rule.within, rank, line_no):
                continue
            found = self._match(rule, text, end, f.chunk)
            if found is None:
                continue
            m, ms, matched, used_end = found
            ev = build_event(
                self.times, rule, m, ms, matched, raw, prefix_attrs, state, line_no, f, start
            )
            if rule.rising is not None:
                grown = risen(rule.id, rule.rising, m, ev, state)
                if grown is None:
                    continue  # the counter did not grow: this line reports nothing new
                ev = grown
            if f.trace is not None:
                f.trace.add(rule.id)
            if ev.kind == "overflow" and ev.fields.get("incident") is False:
                incident = cascade(ev, state, line_no, logged_since(ev, state, f, start))
                if incident is not None:
                    f.events.append(incident)  # its own event: the quiet notices fold together
            if rule.alone:
                f.events.append(ev)
            else:
                report(ev, c.strength[rule.id], state, line_no, f, generic=rule.tier == "generic")
                if f.stage_from_stream and f.events and f.events[-1] is ev:
                    # staged by where the stream was: the frames after its line say where it
                    # failed (context.late_stage)
                    f.weak_stage.add(len(f.events) - 1)
            if state.records and (rule.within is not None or not text[:1].isspace()):
                # a traceback's final line was read (by this rule or a more specific one)
                close_record(state, rank)
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
            m = self._search(rule, joined)
            if m is None or m.start() > len(text):
                return None
            used = joined.count("\n", 0, m.end())
            return m, [m], joined, more[used - 1][1] if used else end
        ms = self._every(rule, text) if rule.all_matches else []
        m = ms[0] if ms else (None if rule.all_matches else self._search(rule, text))
        wrap = WRAP_MIN <= len(text) < rule.max_chars
        if wrap and (m is None or m.end() >= len(text) - 40):
            more = self._following(chunk, end, 1)
            if more and not starts_record(text, more[0][0]):
                joined = text + more[0][0]
                m2 = self._search(rule, joined)
                if (
                    m2 is not None
                    and m2.start() < len(text) <= m2.end()
                    and (m is None or m2.end() > m.end())
                ):
                    ms2 = self._every(rule, joined) if rule.all_matches else [m2]
                    return m2, ms2 or [m2], joined, more[0][1]
        if m is None:
            return None
        return m, ms or [m], text, end

    def _search(self, rule: Rule, text: str) -> Any:
        """``rule``'s first match in at most ``max_chars`` of ``text``, within the time budget."""
        if len(text) <= LONG_LINE and len(text) <= rule.max_chars:
            return rule.cre.search(text)
        try:
            return rule.cre.search(text, 0, rule.max_chars, timeout=MATCH_BUDGET)
        except TimeoutError:
            self._timed_out(rule, len(text))
            return None

    def _every(self, rule: Rule, text: str) -> list[Any]:
        """Every match of ``rule`` (``all = true``), bounded as :meth:`_search` is."""
        if len(text) <= LONG_LINE and len(text) <= rule.max_chars:
            return list(rule.cre.finditer(text))
        try:
            return list(rule.cre.finditer(text, 0, rule.max_chars, timeout=MATCH_BUDGET))
        except TimeoutError:
            self._timed_out(rule, len(text))
            return []

    def _timed_out(self, rule: Rule, size: int) -> None:
        self.counters["rule_timeouts"] += 1
        if rule.id not in self._warned:
            self._warned.add(rule.id)
            log.warning(
                "rule %s (%s) gave up on a line of %d characters after %.2fs: its pattern "
                "backtracks on such lines and needs a fix (counted in nanwatch_rule_timeouts)",
                rule.id,
                rule.source,
                size,
                MATCH_BUDGET,
            )

    def _capped(self, size: int, line_no: int, file: str | None) -> None:
        self.counters["lines_capped"] += 1
        if "<capped>" not in self._warned:
            self._warned.add("<capped>")
            log.warning(
                "%s line %d has %d characters: rules examine the first %d of such lines, the "
                "rest is skipped (counted in nanwatch_lines_capped; logged once)",
                file or "<input>",
                line_no,
                size,
                self._cap,
            )


def _window(text: str, n: int, cut: dict[int, str]) -> str:
    """The first ``n`` characters of ``text``, cut once per length for all rules of a line."""
    if len(text) <= n:
        return text
    got = cut.get(n)
    if got is None:
        got = cut[n] = text[:n]
    return got
