"""`nanwatch doctor`: is this node ready to run the service? Every problem comes with its fix.

The checks live beside it: ``_doctor_node`` (sources, inotify, filesystems),
``_doctor_services`` (database, Slack, metrics address) and ``_doctor_cluster`` (this node's
name, the Alertmanagers it reports to).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from .._dc import dataclass
from ._common import EXIT_ERROR, config_option, db_option, emit_json, json_option


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | warn | fail | skip
    message: str
    fix: str | None = None


def current_user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def as_root_note() -> str:
    if os.geteuid() != 0:
        return ""
    return (
        " (checked as root, who reads everything: `sudo -u nanwatch nanwatch doctor ...` "
        "checks what the service user can read)"
    )


# --- config -------------------------------------------------------------------------------------


def check_config(
    config_path: Path | None, paths: tuple[str, ...] = ()
) -> tuple[Any, list[Finding]]:
    from ..config import Config, load_config
    from ..daemon.service import preflight
    from ..errors import NanwatchError
    from .ingest import _sinks

    out: list[Finding] = []
    if config_path is None:
        out.append(
            Finding(
                "config",
                "warn",
                "no config file given: checking the defaults",
                "pass --config /etc/nanwatch/nanwatch.toml (or set $NANWATCH_CONFIG)",
            )
        )
    try:
        config = load_config(config_path)
    except NanwatchError as e:
        return None, [*out, Finding("config", "fail", str(e), config_fix(config_path, str(e)))]
    if paths:
        # what `nanwatch watch PATH...` would follow, instead of [sources] paths
        config = replace(config, sources=replace(config.sources, paths=tuple(paths)))
    try:
        plan = preflight(config, (), lambda c: _sinks(c, console=False))
    except NanwatchError as e:
        return config or Config(), [*out, Finding("config", "fail", str(e), _fix_of(str(e)))]
    if config_path is not None:
        out.append(
            Finding(
                "config",
                "ok",
                f"{config_path}: valid; {len(plan.paths)} source path(s), "
                f"{len(plan.rules.rules)} rule(s)",
            )
        )
        mode = os.stat(config_path).st_mode
        if mode & stat.S_IWOTH:
            out.append(
                Finding(
                    "permissions",
                    "fail",
                    f"{config_path}: anyone may write it (mode {stat.filemode(mode)})",
                    f"chmod 0644 {config_path}",
                )
            )
    return config, out


def _fix_of(message: str) -> str:
    if "nothing to watch" in message:
        return (
            "list the training log folders in [sources] paths, or check them here with "
            "`nanwatch doctor PATH...`"
        )
    return config_fix(None, message)


# what ConfigError messages name (nanwatch/config.py), most specific first
_WHAT = (
    (re.compile(r"unknown key '(\w+)' in \[(\w+)\]"), "rename or remove {0} in [{1}] of {w}"),
    (re.compile(r"unknown section \[(\w+)\]"), "rename or remove the section [{0}] in {w}"),
    (
        re.compile(r"unknown top-level key '(\w+)'"),
        "rename or remove the key {0} at the top of {w}",
    ),
    (re.compile(r"\[(\w+)\] (\w+)"), "correct the value of {1} in [{0}] of {w}"),
    (re.compile(r"^[^:]+: (\w+): "), "correct the value of {0} at the top of {w}"),
)


def config_fix(config_path: Path | None, message: str) -> str:
    """Say which file and which key to edit, and how to check the result."""
    where = str(config_path) if config_path else "the config file"
    if "config file not found" in message:
        return (
            f"create {where} (systemd/nanwatch.toml is an example) or pass an existing file "
            "to --config"
        )
    if "not valid TOML" in message:
        return f"fix the TOML syntax of {where} at the line and column the message gives"
    what = f"edit {where} where the message points"
    for pattern, text in _WHAT:
        m = pattern.search(message)
        if m:
            what = text.format(*m.groups(), w=where)
            break
    return f"{what}, then run `nanwatch doctor --config {where}` again"


# --- the command ---------------------------------------------------------------------------------


def run_checks(
    config_path: Path | None, db: Path | None, paths: tuple[str, ...] = ()
) -> Iterator[Finding]:
    from ._doctor_cluster import check_alertmanager, check_cluster
    from ._doctor_node import check_filesystems, check_inotify, check_sources
    from ._doctor_services import check_database, check_metrics, check_slack

    config, found = check_config(config_path, paths)
    yield from found
    if config is None:
        return
    if paths:
        config = replace(config, sources=replace(config.sources, paths=tuple(paths)))
    src, dirs, instances, roots = check_sources(config)
    yield from src
    if roots:
        yield check_inotify(dirs, instances)
        yield from check_filesystems(config, roots)
    db_path = db if db is not None else config.db_path()
    yield from check_database(db_path, config)
    inside = [r.spec for r in roots if r.contains(os.path.abspath(db_path))]
    if inside:
        yield Finding(
            "database",
            "warn",
            f"{db_path} lies under the source {inside[0]}: nanwatch would follow its own files",
            "keep the database out of [sources] paths (the unit's /var/lib/nanwatch)",
        )
    yield from check_slack(config)
    yield check_cluster(config)
    yield from check_alertmanager(config)
    yield check_metrics(config)
    from ..detect.prefilter import speed_report

    yield Finding("detect", "ok", speed_report())
    yield check_core()


def check_core() -> Finding:
    """Which chunk core reads iteration lines: the compiled one or pure Python, and why."""
    from ..detect.core import PURE_ENV, status

    compiled, detail = status()
    if compiled:
        return Finding("core", "ok", f"chunk core: compiled ({detail})")
    if detail.startswith(PURE_ENV):
        return Finding("core", "ok", f"chunk core: pure Python (why: {detail})")
    return Finding(
        "core",
        "warn",
        f"chunk core: pure Python (why: {detail}); catch-up scans run several times slower",
        "install a C compiler (gcc or clang) and the Python headers, then reinstall nanwatch "
        "(pip install --force-reinstall --no-deps nanwatch, or pip install -e . in a checkout)",
    )


@click.command()
@config_option
@db_option
@json_option
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
def doctor(
    config_path: Path | None, db: Path | None, as_json: bool, paths: tuple[str, ...]
) -> None:
    """Check that this node can run the nanwatch service, and say how to fix what is wrong.

    PATHs, when given, are checked as the sources instead of `[sources] paths` (what
    `nanwatch watch PATH...` would follow).

    Checks the config (and everything `watch` would refuse at start), the source paths
    (exist, readable), inotify limits against the folders to watch (polling is used where
    they run out), filesystem types (network filesystems are polled), the database (integrity,
    WAL, size, schema version, writable), Slack (auth.test with the token, when [slack] is
    configured), this node's name in alerts, every [alertmanager] URL (its API answers) and
    the metrics address. Exit status 0 when nothing failed (warnings allowed),
    1 otherwise.

    \b
    Examples:
      nanwatch doctor --config /etc/nanwatch/nanwatch.toml
      sudo -u nanwatch nanwatch doctor --config /etc/nanwatch/nanwatch.toml
      nanwatch doctor --json | jq 'select(.status != "ok")'
      nanwatch doctor work_dirs/dino/ /data/logs/job42/
    """
    findings = []
    if not as_json:
        where = config_path or "no config"
        click.echo(f"nanwatch doctor: {where}, as user {current_user()}")
    for f in run_checks(config_path, db, paths):
        findings.append(f)
        if as_json:
            emit_json(asdict(f))
            continue
        click.echo(f"  {f.status:<5} {f.check:<11} {f.message}")
        if f.fix and f.status in ("warn", "fail"):
            click.echo(f"  {'':<5} {'':<11} fix: {f.fix}")
    failed = sum(f.status == "fail" for f in findings)
    warned = sum(f.status == "warn" for f in findings)
    if not as_json:
        verdict = "ready" if not failed else "not ready"
        click.echo(f"{verdict}: {failed} problem(s), {warned} warning(s)")
    if failed:
        raise SystemExit(EXIT_ERROR)
