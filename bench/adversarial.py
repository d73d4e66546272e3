"""The work one line may cost: every rule, alone, on megabyte lines built from its own literals
and example lines repeated without the line structure it needs (where backtracking is worst).

Each line goes through ``Detector.feed`` as the daemon runs it (prefixes stripped, the rule's
length cap and time budget in force), so a figure is what such a line costs the writer thread.
"""

from __future__ import annotations

import time
from typing import Any

from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.detect.bounds import MATCH_BUDGET, adversarial_lines
from nanwatch.detect.rules import RuleSet


def run(mb: float, top: int = 5) -> dict[str, Any]:
    rules = load_rules()
    size = int(mb * 1024 * 1024)
    per_rule: list[tuple[float, str, str]] = []
    lines = timeouts = capped = 0
    t_all = time.perf_counter()
    for rule in rules.rules:
        det = Detector(RuleSet(prefixes=rules.prefixes, rules=[rule]))
        examples = [" ".join(ex.lines) for ex in rule.examples]
        worst, head = 0.0, ""
        for line in adversarial_lines(rule.literals, examples, size):
            data = line.encode("utf-8", "replace") + b"\n"
            t0 = time.perf_counter()
            det.feed(data, 0, StreamState(), "adversarial.log")
            took = time.perf_counter() - t0
            lines += 1
            if took > worst:
                worst, head = took, line[:60]
        timeouts += det.counters["rule_timeouts"]
        capped += det.counters["lines_capped"]
        per_rule.append((worst, rule.id, head))
    per_rule.sort(reverse=True)
    return {
        "mb": mb,
        "rules": len(rules.rules),
        "lines": lines,
        "seconds": round(time.perf_counter() - t_all, 1),
        "worst_ms": round(1000 * per_rule[0][0], 1),
        "worst_rule": per_rule[0][1],
        "top": [{"rule": r, "ms": round(1000 * t, 1), "line": h} for t, r, h in per_rule[:top]],
        "timeouts": timeouts,
        "capped": capped,
        "budget_ms": round(1000 * MATCH_BUDGET),
    }
