"""The examples runner: every ``[[rule.example]]`` must give what it says, *through its own rule*.

One runner for the test suite, ``nanwatch rules --check DIR`` and the start-up check of site
packs. An example passes when the lines give the event, state, metrics and facts it names and
the rule (or prefix) it belongs to took part: an example that another rule happens to match
proves nothing about its own rule, and a disabled or shadowed rule must turn its examples red.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._dc import dataclass
from ..events import Event, Metric
from ..stream import StreamState
from .engine import Detector
from .rules import Example, Prefix, Rule, RuleSet


@dataclass(frozen=True)
class Failure:
    """One example that does not give what it says."""

    source: Path
    rule: str
    index: int  # the example's position among its rule's examples (0-based)
    problem: str

    def __str__(self) -> str:
        return f"{self.source}: rule {self.rule!r}, example {self.index}: {self.problem}"


@dataclass
class Outcome:
    """What an example's lines gave."""

    events: list[Event]
    metrics: list[Metric]
    state: StreamState
    facts: dict[str, Any]
    fired: set[str]  # ids of the prefixes and rules that matched a line


def run_example(detector: Detector, ex: Example) -> Outcome:
    state = StreamState()
    if ex.file:
        from ..sources.discover import rank_from_path

        state.rank = rank_from_path(ex.file)
    data = "".join(line + "\n" for line in ex.lines).encode("utf-8")
    told: list[dict[str, Any]] = []
    fired: set[str] = set()
    events, metrics = detector.feed(data, 0, state, ex.file, facts=told, trace=fired)
    got: dict[str, Any] = {}
    for f in told:
        got.update(flatten(f))
    return Outcome(events, metrics, state, got, fired)


def _positive(ex: Example) -> bool:
    """Does the example say what its rule reads (rather than what it must leave alone)?"""
    if ex.event is not None or ex.metrics is not None or ex.facts:
        return True
    if ex.events:
        return True
    return any(v is not False for k, v in ex.state.items() if k != "hint_stage") or bool(
        ex.state.get("hint_stage")
    )


def _sort(item: Rule | Prefix | None) -> str:
    return "prefix" if isinstance(item, Prefix) else "none" if item is None else item.type


def check_example(detector: Detector, item: Rule | Prefix, ex: Example) -> str | None:
    """The first thing ``ex`` gets wrong, or None."""
    out = run_example(detector, ex)
    if ex.claimed_by is not None:
        # precedence, shown on the weaker rule's side: the stronger rule takes the line
        if ex.claimed_by not in out.fired:
            return f"not claimed by {ex.claimed_by} (fired: {', '.join(sorted(out.fired)) or '-'})"
    elif _positive(ex) and item.id not in out.fired:
        # the rules that took its lines instead: of its own sort (an event rule's lines also
        # wake context rules up, which is no news)
        others = sorted(
            i for i in out.fired - {item.id} if _sort(detector.rules.by_id(i)) == _sort(item)
        )
        via = f" (matched only by {', '.join(others)})" if others else ""
        return f"not matched by its own rule{via}; fix its pattern or literals, or its tier"
    if ex.facts is not None and out.facts != dict(ex.facts):
        return f"facts {out.facts}, want {dict(ex.facts)}"
    events = out.events
    if ex.events is not None and len(events) != ex.events:
        return f"{len(events)} events, want {ex.events}: {[e.message for e in events]}"
    if ex.event is not None:
        if not events:
            return "no event"
        ev = events[-1] if len(ex.lines) > 1 else events[0]
        problem = _event_problem(ev, ex.event)
        if problem:
            return problem
    elif events and not (
        ex.state or ex.metrics is not None or ex.events is not None or ex.facts is not None
    ):
        return f"unexpected event {events[0].message!r}"
    # an event rule's example that gives no event, or any rule's that names nothing to read
    negative = isinstance(item, Rule) and (
        (item.type == "event" and not _positive(ex)) or ex.reads_nothing
    )
    if negative and item.id in out.fired:
        return "a negative example matched its own rule"
    for key, want in ex.state.items():
        if key == "hint_stage":
            if out.state.hint_stage != (None if want is False else want):
                return f"state hint_stage={out.state.hint_stage!r}, want {want!r}"
            continue
        got = getattr(out.state, key, None)
        if want is False:  # "sets nothing": a value that must not be read from the lines
            ev_got = getattr(events[0], key, None) if events else None
            if got or ev_got is not None:
                return f"state {key}={got if got else ev_got!r}, want nothing"
            continue
        # prefixes set per-line attributes, not stream state: check the event or the metric
        if got is None and events:
            got = getattr(events[0], key, None)
        if got is None and out.metrics:
            got = getattr(out.metrics[0], key, None)
        if got is None and isinstance(item, Prefix):
            got = detector.prefix_attrs(ex.lines[0]).get(key)
        if not _same(want, got):
            return f"state {key}={got!r}, want {want!r}"
    if ex.metrics is not None:
        if not out.metrics:
            return "no metrics"
        for key, want in ex.metrics.items():
            got = getattr(out.metrics[-1], key)
            if not _same(want, got):
                return f"metric {key}={got!r}, want {want!r}"
    return None


def _event_problem(ev: Event, want: Mapping[str, Any]) -> str | None:
    for key, value in want.items():
        if key == "fields":
            for fk, fv in value.items():
                if not _same(fv, ev.fields.get(fk)):
                    return f"field {fk}={ev.fields.get(fk)!r}, want {fv!r}"
        elif key == "rule":
            if ev.fields.get("rule") != value:
                return f"rule={ev.fields.get('rule')!r}, want {value!r}"
        elif not _same(value, getattr(ev, key)):
            return f"{key}={getattr(ev, key)!r}, want {value!r} ({ev.message})"
    return None


def check_examples(
    rules: RuleSet,
    items: Iterable[Rule | Prefix] | None = None,
    *,
    detector: Detector | None = None,
) -> list[Failure]:
    """Run the examples of ``items`` (default: every prefix and rule of ``rules``) against a
    detector of the whole of ``rules``; return what fails, in file order."""
    det = detector or Detector(rules, default_year=2026)
    todo: list[Rule | Prefix] = [*rules.prefixes, *rules.rules] if items is None else list(items)
    failures = []
    for item in todo:
        for i, ex in enumerate(item.examples):
            problem = check_example(det, item, ex)
            if problem:
                failures.append(Failure(item.source, item.id, i, problem))
    return failures


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested facts as ``a.b.c -> value`` (how examples name them and `rules` prints them)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        return math.isclose(expected, actual, rel_tol=1e-6)
    return bool(expected == actual)
