"""The detection engine: chunks of complete lines in, events and metrics out.

The hot path works on whole chunks of bytes: chunk rules (iteration lines that occur on every
step) run with one ``finditer`` over the chunk, and one literal prefilter finds the few other
lines worth a closer look. Lines that match neither cost nothing but a newline count.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..events import ATTRIBUTES, Event, Metric
from ..stream import StreamState
from .rules import FIELD_TYPES, Rule, RuleSet, convert, normalize_stage
from .timestamps import TimeParser

_NAMED = re.compile(r"\(\?P<\w+>")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
MESSAGE_MAX = 2000
HINT_WINDOW = 400  # lines a traceback stage hint stays valid


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


class _Compiled:
    """Per-RuleSet precomputation shared by every stream."""

    def __init__(self, rules: RuleSet) -> None:
        self.rules = rules
        self.chunk_rules = [r for r in rules.rules if r.chunk]
        self.line_rules = [r for r in rules.rules if not r.chunk]
        lits = sorted({lit for r in self.line_rules for lit in r.literals}, key=len, reverse=True)
        self.prefilter = (
            re.compile(b"|".join(re.escape(lit.encode("utf-8")) for lit in lits)) if lits else None
        )
        self.context_rules = [r for r in self.line_rules if r.type == "context"]
        self.event_rules = [r for r in self.line_rules if r.type == "event"]
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


class Detector:
    """Applies a RuleSet to streams. Stateless itself: each stream passes its StreamState."""

    def __init__(self, rules: RuleSet, *, default_year: int | None = None) -> None:
        self._c = _Compiled(rules)
        self.rules = rules
        self.times = TimeParser(default_year)

    # -- public ----------------------------------------------------------------------------------

    def feed(
        self, chunk: bytes, base_offset: int, state: StreamState, file: str | None = None
    ) -> tuple[list[Event], list[Metric]]:
        """Process ``chunk`` (complete lines only) that starts at byte ``base_offset``.

        Updates ``state`` in place (line count, context) and returns what the lines yield.
        """
        c = self._c
        hits: dict[int, list[tuple[Rule, Any]]] = {}
        for rule in c.chunk_rules:
            assert rule.chunk_cre is not None
            for m in rule.chunk_cre.finditer(chunk):
                start = chunk.rfind(b"\n", 0, m.start()) + 1
                hits.setdefault(start, []).append((rule, m))
        candidates: set[int] = set()
        if c.prefilter is not None:
            last_end = -1
            for m in c.prefilter.finditer(chunk):
                p = m.start()
                if p < last_end:
                    continue
                start = chunk.rfind(b"\n", 0, p) + 1
                end = chunk.find(b"\n", p)
                last_end = len(chunk) if end < 0 else end
                candidates.add(start)
        events: list[Event] = []
        metrics: list[Metric] = []
        if not hits and not candidates:
            state.line_no += chunk.count(b"\n")
            return events, metrics
        order = sorted(hits.keys() | candidates)
        line_no = state.line_no
        pos = 0
        for start in order:
            line_no += chunk.count(b"\n", pos, start)
            pos = start
            end = chunk.find(b"\n", start)
            if end < 0:
                end = len(chunk)
            this_line = line_no + 1
            prefix_attrs: dict[str, Any] = {}
            text: str | None = None
            is_candidate = start in candidates
            if is_candidate or (c.any_prefix is not None and c.any_prefix.match(chunk, start)):
                text = decode_line(chunk[start:end])
                text, prefix_attrs = self._strip_prefixes(text)
            for rule, m in hits.get(start, ()):
                self._apply_chunk_rule(
                    rule, m, state, base_offset + start, this_line, prefix_attrs, metrics
                )
            if is_candidate:
                assert text is not None
                ev = self._line(
                    text, prefix_attrs, state, this_line, base_offset + start, file, metrics
                )
                if ev is not None:
                    events.append(ev)
        state.line_no += chunk.count(b"\n")
        return events, metrics

    def explain(self, line: str) -> list[dict[str, Any]]:
        """Which rules match ``line`` and what they extract (for ``nanwatch explain``)."""
        out: list[dict[str, Any]] = []
        text, prefix_attrs = self._strip_prefixes(decode_line(line.encode("utf-8")))
        for p in self.rules.prefixes:
            if p.cre.match(decode_line(line.encode("utf-8"))):
                out.append({"rule": p.id, "type": "prefix", "pack": p.pack, "values": prefix_attrs})
                break
        for r in self.rules.rules:
            if not any(lit in text for lit in r.literals):
                continue
            m = r.cre.search(text)
            if m:
                vals = {k: v for k, v in m.groupdict().items() if v is not None}
                out.append(
                    {"rule": r.id, "type": r.type, "kind": r.kind, "pack": r.pack, "values": vals}
                )
        return out

    # -- internals -------------------------------------------------------------------------------

    def _strip_prefixes(self, text: str) -> tuple[str, dict[str, Any]]:
        attrs: dict[str, Any] = {}
        for _ in range(3):
            for p in self.rules.prefixes:
                m = p.cre.match(text)
                if m and m.end() > 0:
                    for k, v in m.groupdict().items():
                        if v is not None and k in ATTRIBUTES:
                            attrs.setdefault(k, int(v) if k in ("rank", "local_rank") else v)
                    text = text[m.end() :]
                    break
            else:
                break
        return text, attrs

    def _set_state(
        self, state: StreamState, values: Mapping[str, Any], line_no: int, hint: bool
    ) -> None:
        stage = values.get("stage")
        if stage is not None:
            stage = normalize_stage(str(stage))
        if hint:
            if stage:
                state.hint_stage = stage
                state.hint_line = line_no
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
        # Epoch-based loops print the iteration within the epoch; the global step follows.
        if values.get("step") is None and state.stage in (None, "train"):
            if state.epoch is not None and state.iter is not None and state.iters:
                state.step = (state.epoch - 1) * state.iters + state.iter
            elif state.iter is not None and state.epoch is None:
                state.step = state.iter

    def _apply_chunk_rule(
        self,
        rule: Rule,
        m: Any,
        state: StreamState,
        offset: int,
        line_no: int,
        prefix_attrs: Mapping[str, Any],
        metrics: list[Metric],
    ) -> None:
        g = {
            k: (v.decode("utf-8", "replace") if v is not None else None)
            for k, v in m.groupdict().items()
        }
        values: dict[str, Any] = {k: v for k, v in g.items() if v is not None}
        values.update(rule.set)
        self._set_state(state, values, line_no, rule.hint)
        ts = g.get("ts")
        when = self.times.parse(ts) if ts else None
        if when:
            state.last_time = when
        if rule.metrics:
            metrics.append(self._metric(rule, g, state, offset, when, prefix_attrs))

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
                    v = float(raw)
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
        prefix_attrs: Mapping[str, Any],
        state: StreamState,
        line_no: int,
        offset: int,
        file: str | None,
        metrics: list[Metric],
    ) -> Event | None:
        when: str | None = None
        for rule in self._c.context_rules:
            if not any(lit in text for lit in rule.literals):
                continue
            m = rule.cre.search(text)
            if m is None:
                continue
            g = m.groupdict()
            values: dict[str, Any] = {k: v for k, v in g.items() if v is not None}
            values.update(rule.set)
            self._set_state(state, values, line_no, rule.hint)
            if g.get("ts"):
                when = self.times.parse(g["ts"])
                if when:
                    state.last_time = when
            if rule.metrics:
                metrics.append(self._metric(rule, g, state, offset, when, prefix_attrs))
        for rule in self._c.event_rules:
            if not any(lit in text for lit in rule.literals):
                continue
            if rule.all_matches:
                ms = list(rule.cre.finditer(text))
                if not ms:
                    continue
                m = ms[0]
            else:
                m = rule.cre.search(text)
                if m is None:
                    continue
                ms = [m]
            return self._event(rule, m, ms, text, prefix_attrs, state, line_no, offset, file, when)
        return None

    def _event(
        self,
        rule: Rule,
        m: Any,
        ms: list[Any],
        text: str,
        prefix_attrs: Mapping[str, Any],
        state: StreamState,
        line_no: int,
        offset: int,
        file: str | None,
        when: str | None,
    ) -> Event:
        g = {k: v for k, v in m.groupdict().items() if v is not None}
        attrs: dict[str, Any] = {}
        fields: dict[str, Any] = dict(rule.const)
        for k, v in g.items():
            if k.startswith("_") or k in ("ts", "iters"):
                continue
            if k in ATTRIBUTES:
                if k in ("rank", "local_rank", "epoch", "iter", "step"):
                    try:
                        attrs[k] = int(v)
                    except ValueError:
                        continue
                elif k == "stage":
                    st = normalize_stage(v)
                    if st:
                        attrs[k] = st
                elif k == "device":
                    attrs[k] = v.lower()
                else:
                    attrs[k] = v
            else:
                typ = rule.types.get(k) or FIELD_TYPES.get(k, "str")
                fields[k] = convert(v, typ)
        if rule.all_matches and len(ms) > 1:
            for k in list(fields):
                vals = []
                for mm in ms:
                    val = mm.groupdict().get(k)
                    if val is not None and val not in vals:
                        vals.append(val)
                if len(vals) > 1:
                    fields[k + "s"] = vals
        ts = g.get("ts")
        if ts:
            when = self.times.parse(ts)
        if when is None:
            when = self.times.parse(text)
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
        if rule.message:
            try:
                message = rule.message.format(**{**fields, **g})
            except (KeyError, IndexError, ValueError):
                message = text.strip()
        else:
            message = text.strip()
        if len(message) > MESSAGE_MAX:
            message = message[:MESSAGE_MAX] + "…"
        device = attrs.get("device") or fields.pop("device", None) or state.device
        return Event(
            kind=str(rule.kind),
            message=message,
            offset=offset,
            time=when,
            file=file,
            line=line_no,
            rank=attrs.get("rank", prefix_attrs.get("rank", state.rank)),
            local_rank=attrs.get("local_rank", prefix_attrs.get("local_rank", state.local_rank)),
            node=attrs.get("node", prefix_attrs.get("node", state.node)),
            epoch=attrs.get("epoch", state.epoch),
            iter=attrs.get("iter", state.iter),
            step=attrs.get("step", state.step),
            stage=stage,
            device=device,
            fields={"rule": rule.id, **fields},
        )
