"""Shell completion: `_NANWATCH_COMPLETE={bash,zsh,fish}_source nanwatch` prints a script that
completes commands and options, lazily loaded commands included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, nanwatch


@pytest.mark.parametrize(
    ("shell", "marker"),
    [
        ("bash", "complete -o nosort -F _nanwatch_completion nanwatch"),
        ("zsh", "compdef _nanwatch_completion nanwatch"),
        ("fish", 'complete --no-files --command nanwatch --arguments "(_nanwatch_completion)"'),
    ],
)
def test_each_shell_gets_a_completion_script(shell: str, marker: str) -> None:
    got = nanwatch(env={"_NANWATCH_COMPLETE": f"{shell}_source"})
    assert marker in got.stdout
    assert f"_NANWATCH_COMPLETE={shell}_complete" in got.stdout


def _complete(shell: str, words: str, cword: str) -> list[str]:
    got = nanwatch(
        env={"_NANWATCH_COMPLETE": f"{shell}_complete", "COMP_WORDS": words, "COMP_CWORD": cword}
    )
    return got.stdout.splitlines()


def test_zsh_and_fish_complete_commands_with_their_help() -> None:
    zsh = _complete("zsh", "nanwatch inc", "1")
    assert zsh[:2] == ["plain", "incidents"] and zsh[2].startswith("List incidents")
    (fish,) = _complete("fish", "nanwatch inc", "inc")
    assert fish.startswith("plain,incidents\tList incidents")


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completes_commands_and_the_options_of_a_lazy_command(tmp_path: Path) -> None:
    # the script calls `nanwatch` by name: a wrapper on PATH runs this checkout
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "nanwatch"
    wrapper.write_text(
        f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m nanwatch "$@"\n',
        encoding="utf-8",
    )
    wrapper.chmod(0o755)
    script = (
        'eval "$(_NANWATCH_COMPLETE=bash_source nanwatch)"\n'
        "ask() { COMPREPLY=(); COMP_WORDS=($1); COMP_CWORD=$2;"
        ' _nanwatch_completion nanwatch; echo "${COMPREPLY[*]}"; }\n'
        "ask 'nanwatch pl' 1\n"
        "ask 'nanwatch plot --o' 2\n"
        "ask 'nanwatch sil' 1\n"
    )
    got = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == ["plot", "--output", "silence silences"]
