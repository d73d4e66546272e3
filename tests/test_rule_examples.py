"""Every [[example]] of every rule pack in parsers/ must give what it says (STYLE.md, 5)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.detect.rules import Example

RULES = load_rules()
DETECTOR = Detector(RULES, default_year=2026)


def _cases() -> list[Any]:
    cases = []
    for item in [*RULES.prefixes, *RULES.rules]:
        for i, ex in enumerate(item.examples):
            cases.append(pytest.param(item, ex, id=f"{item.id}[{i}]"))
    return cases


def run_example(
    ex: Example, facts: list[dict[str, Any]] | None = None
) -> tuple[list[Any], list[Any], StreamState]:
    state = StreamState()
    if ex.file:
        from nanwatch.sources.discover import rank_from_path

        state.rank = rank_from_path(ex.file)
    data = "".join(line + "\n" for line in ex.lines).encode("utf-8")
    events, metrics = DETECTOR.feed(data, 0, state, ex.file, facts=facts)
    return events, metrics, state


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        return math.isclose(expected, actual, rel_tol=1e-6)
    return bool(expected == actual)


@pytest.mark.parametrize(("rule", "example"), _cases())
def test_example(rule: Any, example: Example) -> None:
    told: list[dict[str, Any]] = []
    events, metrics, state = run_example(example, told)
    if example.facts is not None:
        got: dict[str, Any] = {}
        for f in told:
            got.update(_flat(f))
        assert got == dict(example.facts), f"{rule.id}: facts {got}, want {dict(example.facts)}"
    if example.events is not None:
        assert len(events) == example.events, [e.message for e in events]
    if example.event is not None:
        assert events, f"{rule.id}: no event for {example.lines}"
        ev = events[-1] if len(example.lines) > 1 else events[0]
        for key, want in example.event.items():
            if key == "fields":
                for fk, fv in want.items():
                    assert _same(fv, ev.fields.get(fk)), (
                        f"{rule.id}: field {fk}={ev.fields.get(fk)!r}, want {fv!r}"
                    )
            elif key == "rule":
                assert ev.fields.get("rule") == want
            else:
                assert _same(want, getattr(ev, key)), (
                    f"{rule.id}: {key}={getattr(ev, key)!r}, want {want!r} ({ev.message})"
                )
    elif (
        "event" in example.__dataclass_fields__
        and example.event is None
        and not example.state
        and example.metrics is None
        and example.events is None
        and example.facts is None
    ):
        assert not events, f"{rule.id}: unexpected event {events[0].message!r}"
    for key, want in example.state.items():
        if key == "hint_stage":
            assert state.hint_stage == want
        elif want is False:  # "sets nothing": a value that must not be read from the line
            assert not getattr(state, key), f"{rule.id}: state {key}={getattr(state, key)!r}"
        else:
            got = getattr(state, key)
            # prefixes set per-line attributes, not stream state: check the event or the metric
            if got is None and events:
                got = getattr(events[0], key, None)
            if got is None and metrics:
                got = getattr(metrics[0], key, None)
            if got is None and rule.__class__.__name__ == "Prefix":
                _, attrs = DETECTOR._strip_prefixes(example.lines[0])
                got = attrs.get(key)
            assert _same(want, got), f"{rule.id}: state {key}={got!r}, want {want!r}"
    if example.metrics is not None:
        assert metrics, f"{rule.id}: no metrics"
        for key, want in example.metrics.items():
            assert _same(want, getattr(metrics[-1], key)), (
                f"{rule.id}: metric {key}={getattr(metrics[-1], key)!r}, want {want!r}"
            )


def test_every_rule_has_examples() -> None:
    missing = [r.id for r in RULES.rules if not r.examples]
    assert not missing, f"rules without [[rule.example]]: {missing}"


def test_every_event_rule_has_a_negative_or_positive_example() -> None:
    for r in RULES.rules:
        if r.type == "event":
            assert any(ex.event is not None for ex in r.examples), f"{r.id}: no positive example"
