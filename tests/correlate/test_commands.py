"""Suggested commands are pasted into shells: values from folder and tensor names stay data.

Every command of every shipped known cause is filled with hostile run names, paths and tensor
names, checked by ``bash -n`` and then run by bash in a sandbox whose PATH holds only stubs
(each records its argv) and a real ``touch``. No injected file may appear, and the stubs must
receive the value as one intact argument.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nanwatch.correlate.commands import check_command, fill_command
from nanwatch.correlate.knowledge import Knowledge, Situation
from nanwatch.errors import RuleError
from nanwatch.notify.slack_text import details_text, parent_blocks

KB = Knowledge.load(node_facts=False)
BASH = shutil.which("bash")
TOUCH = shutil.which("touch")

HOSTILE = [
    "x'$(touch${IFS}PWNED)'",
    "x$(touch PWNED)",
    "x`touch PWNED`",
    "x; touch PWNED",
    'x"; touch PWNED; "',
    "x\ntouch PWNED\n",
    "x${IFS}&&${IFS}touch${IFS}PWNED",
    "x' ; :>PWNED ; '",
    "a b | touch PWNED",
    "\\'; touch PWNED #",
]

# every program a shipped command runs, as a stub that writes its argv (NUL-separated)
STUBS = [
    "nanwatch",
    "grep",
    "cat",
    "python",
    "ps",
    "npu-smi",
    "nvidia-smi",
    "env",
    "dmesg",
    "journalctl",
    "head",
    "jq",
    "sort",
    "uniq",
]


def _sandbox(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in STUBS:
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\nprintf "%s\\0" {name} "$@" >> "$ARGV_LOG"\nexit 0\n')
        stub.chmod(0o755)
    assert TOUCH is not None
    (bin_dir / "touch").symlink_to(TOUCH)  # an injection that runs touch must show
    return bin_dir


def _hostile_situation(value: str) -> Situation:
    return Situation(
        kind="nan",
        origin={"rank": value, "stage": value, "step": value, "tensor": value, "module": value},
        versions={"cann": value, "torch": value},
        run=value,
        work_dir=f"/data/{value}",
    )


def _all_commands() -> list[object]:
    out = []
    for cause in KB.causes:
        for i in range(len(cause.commands)):
            out.append(pytest.param(cause, i, id=f"{cause.id}-{i}"))
    return out


@pytest.mark.skipif(BASH is None or TOUCH is None, reason="needs bash and touch")
@pytest.mark.parametrize(("cause", "index"), _all_commands())
def test_shipped_commands_never_run_injected_code(cause: Any, index: int, tmp_path: Path) -> None:
    assert BASH is not None
    template = cause.commands[index]
    bin_dir = _sandbox(tmp_path)
    for n, value in enumerate(HOSTILE):
        cmd = cause.hint(_hostile_situation(value))["commands"][index]
        work = tmp_path / f"w{n}"
        work.mkdir()
        log = work / "argv.log"
        env = {"PATH": str(bin_dir), "ARGV_LOG": str(log), "HOME": str(work)}
        syntax = subprocess.run(
            [BASH, "--norc", "-n", "-c", cmd], capture_output=True, text=True, env=env, timeout=10
        )
        assert syntax.returncode == 0, f"{cmd!r}: {syntax.stderr}"
        subprocess.run(
            [BASH, "--norc", "-c", cmd],
            cwd=work,
            env=env,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=10,
        )
        made = sorted(p.name for p in work.iterdir() if p.name != "argv.log")
        assert not made, f"{cmd!r} created {made}"
        argv = log.read_text().split("\0") if log.exists() else []
        if "{run}" in template:
            assert value in argv, f"{cmd!r}: the run name did not arrive intact: {argv}"
        if "{work_dir}" in template:
            assert any(a.startswith(f"/data/{value}/") for a in argv), f"{cmd!r}: {argv}"


@pytest.mark.parametrize(
    ("template", "value", "words"),
    [
        ("nanwatch events --run {run}", "a b", ["nanwatch", "events", "--run", "a b"]),
        ("nanwatch events --run {run}", "$(id)`id`", ["nanwatch", "events", "--run", "$(id)`id`"]),
        # a site template that quotes the value itself still gives one intact word
        ("nanwatch events --run '{run}'", "x'y", ["nanwatch", "events", "--run", "x'y"]),
        ("nanwatch events --run 'r={run}.'", "x'y", ["nanwatch", "events", "--run", "r=x'y."]),
        ('grep -r "{run}/x" .', '$(id)"', ["grep", "-r", '$(id)"/x', "."]),
        ("grep -r a\\'{run}", "x y", ["grep", "-r", "a'x y"]),
    ],
)
def test_fill_command_quotes_every_value(template: str, value: str, words: list[str]) -> None:
    got = fill_command(template, {"run": value})
    assert _bash_words(got) == words, got


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # an unknown value is the usual fill-in placeholder, never a broken quote
        ("nanwatch events --run {run}", "nanwatch events --run '<run>'"),
        ("nanwatch events --run '{run}'", "nanwatch events --run '''<run>'''"),
        # braces that are not placeholders (awk, shell) are left alone
        ("awk '{print $1}' {work_dir}/x {other}", "awk '{print $1}' '<work_dir>'/x {other}"),
    ],
)
def test_absent_values_render_as_placeholders(template: str, expected: str) -> None:
    assert fill_command(template, {"run": None, "work_dir": None}) == expected


def _bash_words(cmd: str) -> list[str]:
    assert BASH is not None
    out = subprocess.run(
        [BASH, "--norc", "-c", f"set -- {cmd}; printf '%s\\0' \"$@\""],
        capture_output=True,
        timeout=10,
        env={"PATH": os.defpath},
    )
    return out.stdout.decode().split("\0")[:-1]


def test_a_template_with_an_open_quote_is_refused(tmp_path: Path) -> None:
    assert check_command("grep -rn 'x' <that rank's log>") is not None
    assert check_command("nanwatch events --run {run}") is None
    folder = tmp_path / "kb"
    folder.mkdir()
    (folder / "site.toml").write_text(
        '[[cause]]\nid = "site-x"\ntitle = "t"\ntext = "t"\n'
        "commands = [\"grep -rn 'x' <that rank's log>\"]\n"
        '[cause.when]\nkind = ["oom"]\n'
        '[[cause.example]]\nkind = "oom"\n[[cause.counterexample]]\nkind = "nan"\n'
    )
    with pytest.raises(RuleError, match=r"site\.toml.*site-x.*commands\[0\].*never closed"):
        Knowledge.load([folder], node_facts=False)


@pytest.mark.skipif(BASH is None or TOUCH is None, reason="needs bash and touch")
def test_the_command_shown_in_slack_stays_quoted(tmp_path: Path) -> None:
    """What a reader copies out of the Slack message's code block is as safe as `show`'s."""
    cause = next(c for c in KB.causes if any("{run}" in t for t in c.commands))
    index = next(i for i, t in enumerate(cause.commands) if "{run}" in t)
    bin_dir = _sandbox(tmp_path)
    for n, value in enumerate([*HOSTILE, "x`;touch PWNED;`", "x`id`'$(id)'"]):
        hint = cause.hint(_hostile_situation(value))
        hint["commands"] = [hint["commands"][index]]
        inc = {"id": 7, "title": "t", "kind": "nan", "hints": [hint]}
        texts = [
            b["text"]["text"] for b in parent_blocks(inc) if b["type"] == "section" and "text" in b
        ]
        (shown,) = [ln for t in texts for ln in t.split("\n") if ln.startswith("*Next:* `")]
        # the parent's code span, and the thread's code block
        codes = [shown[len("*Next:* `") : -1], details_text(inc).split("```")[1]]
        for k, code in enumerate(codes):
            pasted = html.unescape(code)  # what Slack displays, and a reader copies
            work = tmp_path / f"s{n}-{k}"
            work.mkdir()
            env = {"PATH": str(bin_dir), "ARGV_LOG": str(work / "argv.log"), "HOME": str(work)}
            assert BASH is not None
            subprocess.run(
                [BASH, "--norc", "-c", pasted], cwd=work, env=env, capture_output=True, timeout=10
            )
            made = sorted(p.name for p in work.iterdir() if p.name != "argv.log")
            assert not made, f"{pasted!r} created {made}"
