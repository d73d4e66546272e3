"""What a command loads: the lazy boundaries that keep the CLI's start fast.

Each command runs as a process of its own, which writes the names of every module it holds
(``sys.modules``) as it exits: modules loaded through ``importlib.import_module`` (the CLI's
subcommands, ``nanwatch.detect``'s names) included, which ``-X importtime`` does not list. The
tests assert modules, not times.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT

# loaded only when their input or configuration shows up
OPTIONAL_PACKAGES = (
    "slack_sdk",
    "watchdog",
    "prometheus_client",
    "psycopg",
    "hyperscan",
    "ahocorasick_rs",
    "regex",
    "multiprocessing",
)
# the msprobe row and dump readers (a monitor CSV or dump), checkpoint shapes, the knowledge
# base (a first incident), the worker pool (a big scan), the watcher (`watch`), the senders
# (a configured sink), the fleet store, the detection engine and its line readers (a first
# text file)
LAZY_FOR_SCAN = (
    "nanwatch.detect.engine",
    "nanwatch.detect.compiled",
    "nanwatch.detect.columns",
    "nanwatch.detect.progress",
    "nanwatch.detect.reports",
    "nanwatch.detect.timestamps",
    "nanwatch.detect.msprobe.csvrows",
    "nanwatch.detect.msprobe.rows",
    "nanwatch.detect.msprobe.dump",
    "nanwatch.detect.msprobe.names",
    "nanwatch.correlate.nan",
    "nanwatch.correlate.nanloc",
    "nanwatch.correlate.shapes",
    "nanwatch.correlate.checkpoint",
    "nanwatch.correlate.knowledge",
    "nanwatch.detect.pool",
    "nanwatch.sources.watcher",
    "nanwatch.notify",
    "nanwatch.notify.outbox",
    "nanwatch.notify.slack",
    "nanwatch.notify.slack_api",
    "nanwatch.notify.alertmanager",
    "nanwatch.notify.forward",
    "nanwatch.store.fleet",
)


# the child: run ``nanwatch ARGS`` and, whatever its exit, write the modules it loaded
_CHILD = """
import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv[0] = "nanwatch"
runpy.run_module("nanwatch", run_name="__main__", alter_sys=True)
"""


def imported(*args: str, cwd: Path) -> set[str]:
    """The modules ``nanwatch ARGS`` imports (it must succeed), with a rule cache of its own
    in ``cwd`` (a first start parses and compiles the packs; every later one reads the cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
    env["PYTHONPATH"] = str(ROOT)
    env["NANWATCH_CACHE"] = str(cwd / "cache")
    out = cwd / "modules.txt"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = set(out.read_text().split())
    out.unlink()
    assert "nanwatch.cli" in names  # the output was read right
    return names


def loaded(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def test_scan_of_an_empty_file_loads_no_reader_sender_or_optional_package(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    scan = ("scan", "--json", "--db", str(tmp_path / "nw.db"), str(empty))
    imported(*scan, cwd=tmp_path)  # fills the rule cache
    names = imported(*scan, cwd=tmp_path)
    assert "nanwatch.daemon.pipeline" in names
    assert loaded(names, OPTIONAL_PACKAGES) == []
    assert loaded(names, LAZY_FOR_SCAN) == []


def test_help_and_read_commands_load_no_detection(tmp_path: Path) -> None:
    db = tmp_path / "nw.db"
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    imported("scan", "--db", str(db), str(empty), cwd=tmp_path)
    heavy = ("nanwatch.detect", "nanwatch.daemon", "nanwatch.sources", "nanwatch.correlate")
    for args in (("--help",), ("incidents", "--db", str(db)), ("events", "--db", str(db))):
        names = imported(*args, cwd=tmp_path)
        assert loaded(names, heavy) == [], args
        assert loaded(names, OPTIONAL_PACKAGES) == [], args
        assert loaded(names, ("nanwatch.notify", "nanwatch.store.fleet", "tomllib")) == [], args


def test_scan_and_watch_help_load_neither_config_nor_store(tmp_path: Path) -> None:
    for args in (("scan", "--help"), ("watch", "--help")):
        names = imported(*args, cwd=tmp_path)
        assert "nanwatch.cli.ingest" in names, args
        assert loaded(names, ("nanwatch.config", "nanwatch.store", "sqlite3")) == [], args
        assert loaded(names, ("nanwatch.detect", "nanwatch.daemon", "nanwatch.sources")) == [], args


def test_the_records_every_start_builds_carry_a_docstring() -> None:
    """A dataclass without one gets a docstring made from ``inspect.signature`` as its module
    loads: the config's sections and the rule packs' records are built by every start."""
    import dataclasses

    from nanwatch import config
    from nanwatch.detect import rules

    classes = [
        v
        for mod in (config, rules)
        for v in vars(mod).values()
        if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == mod.__name__
    ]
    assert len(classes) >= 15
    generated = [c.__name__ for c in classes if (c.__doc__ or "").startswith(c.__name__ + "(")]
    assert generated == []
