"""The work one line may cost is bounded for every rule: shipped packs, site packs, long lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import regex

from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.detect.bounds import LINE_LIMIT, adversarial_lines, lint
from nanwatch.detect.rules import Prefix, Rule
from nanwatch.errors import RuleError

RULES = load_rules()
# a little beyond the cap: what a rule examines of a megabyte line is its first LINE_LIMIT
ADVERSARIAL = LINE_LIMIT + 4096
# A linear pattern takes ~0.1 s at most on such a line here (the bench records the worst), a
# quadratic one from 5 s to minutes: the allowance leaves room for a loaded machine.
ALLOWANCE = 2.0
MMENGINE_OLD = (
    r"(?<![\w.])(?P<tensor>(?:[\w.]*\.)?\w*loss\w*|grad_norm)(?::\s*|=)"
    r"(?P<value>[-+]?(?:nan|inf|NaN|Inf|INF|NAN))(?![\w])(?<=(?:Epoch|Iter)(?:\(\w+\)| ?\[)[^\n]*)"
)


def adversarial(rule: Rule | Prefix, size: int = ADVERSARIAL) -> list[str]:
    examples = [" ".join(ex.lines) for ex in rule.examples]
    return adversarial_lines(getattr(rule, "literals", ()), examples, size)


def _bounded(cre: regex.Pattern[str], line: str, limit: int, every: bool) -> None:
    # as the engine runs it: every match for `all = true`, else the first
    if every:
        for _ in cre.finditer(line, 0, limit, timeout=ALLOWANCE):
            pass
    else:
        cre.search(line, 0, limit, timeout=ALLOWANCE)


@pytest.mark.parametrize("rule", [*RULES.rules, *RULES.prefixes], ids=lambda r: r.id)
def test_every_shipped_pattern_is_bounded_on_adversarial_lines(rule: Rule | Prefix) -> None:
    limit = getattr(rule, "max_chars", 4096)
    assert limit <= LINE_LIMIT * 4
    assert lint(rule.pattern) is None
    # chunk rules run with the stdlib engine; `regex` backtracks the same way, with a budget
    cre = regex.compile(rule.pattern, regex.V0)
    every = getattr(rule, "all_matches", False)
    for line in adversarial(rule):
        _bounded(cre, line, limit, every)


def test_the_old_mmengine_pattern_was_quadratic_and_is_refused() -> None:
    line = "loss: nan " * (ADVERSARIAL // 10)
    with pytest.raises(TimeoutError):
        _bounded(regex.compile(MMENGINE_OLD, regex.V0), line, LINE_LIMIT, True)
    assert "lookbehind of unbounded length" in str(lint(MMENGINE_OLD))


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(?<=Epoch[^\n]*)loss: nan", "lookbehind of unbounded length"),
        (r"(?<!best\w+ )loss: nan", "lookbehind of unbounded length"),
        (r"(?:\w+\s?)*loss: nan", "nested unbounded quantifiers"),
        (r"(a+)+b", "nested unbounded quantifiers"),
        (r"x(?:(?!\s+at \()[^,\n])*y", "nested unbounded quantifiers"),
    ],
)
def test_lint_refuses_unbounded_shapes(pattern: str, why: str) -> None:
    assert why in str(lint(pattern))


@pytest.mark.parametrize(
    "pattern",
    [
        r"(?<=pid=\d{1,10}\) )step:(?P<step>\d+)",
        r"\d{1,3}(?:\.\d{1,3}){3}",
        r"^\s*(?P<epoch>\d+)/\d+(?:\s+[\d.]+)*+\s+(?P<value>nan|inf)\b",
        r"(?>(?:\w+\s)*)nan",
        r"(?P<rank>\d+)|(?P<rank>x\d+)",  # a repeated group name (regex syntax) is read too
        r"(?:^(?>[^\n]*?Epoch)|\G(?!^))[^\n]*?loss: nan",
        r"\p{L}+: nan",
    ],
)
def test_lint_accepts_bounded_shapes(pattern: str) -> None:
    assert lint(pattern) is None


def _pack(tmp_path: Path, pattern: str, *, kind: str = "rule", extra: str = "") -> Path:
    d = tmp_path / "site"
    d.mkdir(exist_ok=True)
    body = (
        f"[[prefix]]\nid = 'site.prefix'\npattern = '''{pattern}'''\n"
        if kind == "prefix"
        else f"[[rule]]\nid = 'site.slow'\nkind = 'nan'\nliterals = ['nan']\n"
        f"pattern = '''{pattern}'''\n{extra}"
    )
    (d / "site.toml").write_text(f"[pack]\nid = 'site'\n{body}")
    return d


def test_a_site_pack_with_an_unbounded_pattern_fails_at_load(tmp_path: Path) -> None:
    d = _pack(tmp_path, r"(?<=Epoch[^\n]*)loss: (?P<value>nan)")
    with pytest.raises(RuleError) as e:
        load_rules([d])
    msg = str(e.value)
    assert "site.toml" in msg and "site.slow" in msg and "lookbehind of unbounded length" in msg
    assert "bound it" in msg  # the fix
    d = _pack(tmp_path, r"^(?:\[\w+\]\s*)+", kind="prefix")
    with pytest.raises(RuleError, match=r"site.prefix.*nested unbounded quantifiers"):
        load_rules([d])


def test_max_chars_is_checked(tmp_path: Path) -> None:
    with pytest.raises(RuleError, match=r"site.slow.*max_chars must be an integer"):
        load_rules([_pack(tmp_path, r"loss: (?P<value>nan)", extra="max_chars = 'big'\n")])


EPOCH = "2026/11/30 10:00:05 - mmengine - INFO - Epoch(train)  [1][10/16]  lr: 1.0000e-04  "


def _feed(detector: Detector, text: str) -> list[str]:
    events, _ = detector.feed(text.encode() + b"\n", 0, StreamState(), "rank0.log")
    return [str(e.fields.get("rule")) for e in events]


def test_a_long_line_is_examined_up_to_the_cap_and_counted() -> None:
    det = Detector(RULES)
    filler = "memory: 21034  " * (4 * 1024 * 1024 // 15)  # 4 MiB: what the sources hand over
    # within the first 64 KiB: found, however long the line
    assert _feed(det, EPOCH + "loss: nan  " + filler) == ["mmengine.nonfinite"]
    assert det.counters["lines_capped"] == 1
    # past the cap: skipped (its literals too: the prefilter stops looking), not a crash
    assert _feed(det, EPOCH + filler + "loss: nan") == []
    assert det.counters["rule_timeouts"] == 0


def test_a_rule_says_how_much_of_a_line_it_examines(tmp_path: Path) -> None:
    site = _pack(tmp_path, r"SITE loss: (?P<value>nan)", extra="max_chars = 100\n")
    det = Detector(load_rules([site], builtin=False))
    assert _feed(det, "SITE loss: nan") == ["site.slow"]
    assert _feed(det, "x" * 100 + " SITE loss: nan") == []


def test_many_values_on_one_line_cost_one_pass() -> None:
    det = Detector(RULES)
    # no Epoch/Iter marker: thousands of candidate values, none of them counts
    assert _feed(det, "loss: nan " * 100_000) == ["common.nonfinite"]
    # with the marker, every value after it is one match of the same event
    events, _ = det.feed(
        (EPOCH + " ".join(f"loss_{i}: nan" for i in range(3000)) + "\n").encode(),
        0,
        StreamState(),
    )
    assert len(events) == 1 and events[0].fields["tensor"] == "loss_0"
    assert len(events[0].fields["tensors"]) == 3000
    assert det.counters["rule_timeouts"] == 0


def test_scan_reports_capped_lines(tmp_path: Path) -> None:
    import json

    from ..conftest import nanwatch

    log = tmp_path / "rank0.log"
    log.write_text(EPOCH + "loss: nan  " + "memory: 21034  " * 10_000 + "\n")
    out = nanwatch("scan", "--json", "--db", str(tmp_path / "nw.db"), str(log)).stdout
    summary = json.loads(out.splitlines()[-1])
    assert summary["events"] == {"nan": 1}
    assert summary["counters"]["lines_capped"] == 1
    assert summary["counters"].get("rule_timeouts", 0) == 0
