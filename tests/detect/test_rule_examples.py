"""Every [[example]] of every rule pack in parsers/ must give what it says, through its own rule
(STYLE.md, 5). The runner is the one `nanwatch rules --check` and the site-pack check use."""

from __future__ import annotations

from typing import Any

import pytest

from nanwatch.detect import Detector, load_rules
from nanwatch.detect.examples import check_example, check_examples
from nanwatch.detect.rules import TIERS, Example, RuleSet

RULES = load_rules()
DETECTOR = Detector(RULES, default_year=2026)


def _cases() -> list[Any]:
    cases = []
    for item in [*RULES.prefixes, *RULES.rules]:
        for i, ex in enumerate(item.examples):
            cases.append(pytest.param(item, ex, id=f"{item.id}[{i}]"))
    return cases


@pytest.mark.parametrize(("rule", "example"), _cases())
def test_example(rule: Any, example: Example) -> None:
    problem = check_example(DETECTOR, rule, example)
    assert problem is None, f"{rule.source.name}: {rule.id}: {problem}"


def test_every_rule_has_examples() -> None:
    missing = [r.id for r in RULES.rules if not r.examples]
    assert not missing, f"rules without [[rule.example]]: {missing}"


def test_every_event_rule_has_a_negative_or_positive_example() -> None:
    for r in RULES.rules:
        if r.type == "event":
            assert any(ex.event is not None for ex in r.examples), f"{r.id}: no positive example"


def test_disabled_rules_turn_their_examples_red() -> None:
    """Other rules give the same events for these two rules' lines: an example runner that only
    compares events would stay green with both rules gone."""
    gone = {"process.elastic_sigkill", "process.summary_sigkill"}
    kept = RuleSet(RULES.packs, RULES.prefixes, [r for r in RULES.rules if r.id not in gone])
    failures = check_examples(kept, [r for r in RULES.rules if r.id in gone])
    assert {f.rule for f in failures} == gone
    text = "\n".join(str(f) for f in failures)
    assert "process.toml: rule 'process.elastic_sigkill', example 0: not matched by its own" in text
    assert "matched only by process.elastic_failed" in text


def test_a_shadowed_rule_is_named() -> None:
    """A rule listed below a rule of its tier that takes the same lines never matches them."""
    first = next(r for r in RULES.rules if r.id == "process.elastic_failed")
    shadowed = next(r for r in RULES.rules if r.id == "process.elastic_sigkill")
    order = [first, *(r for r in RULES.rules if r is not first)]
    failures = check_examples(RuleSet(RULES.packs, RULES.prefixes, order), [shadowed])
    assert failures and {f.rule for f in failures} == {"process.elastic_sigkill"}


def test_shipped_event_rules_use_every_tier() -> None:
    used = {r.tier for r in RULES.rules if r.type == "event"}
    assert used == set(TIERS)
