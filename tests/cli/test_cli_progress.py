"""Long commands show a progress bar on stderr when it is a terminal, and only then."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.demo.simulate import TrainingRun

from ..conftest import ROOT


def _stderr_on_a_terminal(args: list[str]) -> tuple[str, str]:
    """Run the CLI with stderr on a pseudo-terminal and stdout piped: (stdout, terminal)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanwatch", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
        cwd=ROOT,
        text=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait(timeout=120)
    if proc.stdout:
        proc.stdout.close()
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode()
    return out, b"".join(chunks).decode()


def _logs(tmp_path: Path) -> Path:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, nan_rank=1, nan_at=(1, 4))
    run.write()
    return run.work_dir


def test_scan_shows_bytes_files_rate_and_eta_on_a_terminal(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    out, tty = _stderr_on_a_terminal(["scan", "--db", str(tmp_path / "a.db"), str(logs)])
    assert "Scanning" in tty and "100%" in tty
    assert " MB, 2 files, " in tty and "MB/s" in tty
    assert "Scanning" not in out and "Scanned 2 file(s)" in out
    # --json: a script reads it, even from a terminal
    out, tty = _stderr_on_a_terminal(["scan", "--json", "--db", str(tmp_path / "b.db"), str(logs)])
    assert "Scanning" not in tty and json.loads(out)["files"] == 2


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["scan", "--db", str(tmp_path / "a.db"), str(_logs(tmp_path))])
    assert r.exit_code == 0 and "Scanning" not in r.stderr and "%" not in r.stderr


def test_check_dataset_and_merge_show_progress_on_a_terminal(tmp_path: Path) -> None:
    ann = tmp_path / "train.json"
    ann.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "a.jpg", "width": 10, "height": 10}],
                "annotations": [],
                "categories": [{"id": 1, "name": "person"}],
            }
        )
    )
    _, tty = _stderr_on_a_terminal(["check-dataset", str(ann)])
    assert "Reading train.json" in tty and "100%" in tty
    _, tty = _stderr_on_a_terminal(["check-dataset", "--json", str(ann)])
    assert "Reading" not in tty

    logs = _logs(tmp_path)
    node = tmp_path / "node-a.db"
    assert CliRunner().invoke(cli, ["scan", "--db", str(node), str(logs)]).exit_code == 0
    _, tty = _stderr_on_a_terminal(["merge", str(tmp_path / "fleet.db"), str(node)])
    assert "Merging" in tty and "1 database(s)" in tty
