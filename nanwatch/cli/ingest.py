"""`nanwatch watch` and `nanwatch scan`: the same pipeline, live or once."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..errors import NanwatchError
from ._common import (
    EXIT_UNFIXABLE,
    EXIT_VERDICT,
    config_option,
    db_option,
    emit_json,
    handle_errors,
    json_option,
    resolve,
    setup_logging,
    verbosity_option,
)
from ._progress import Progress, tree_size

if TYPE_CHECKING:
    from ..config import Config
    from ..notify.outbox import Sink
    from ..store import Store
    from ..store.fleet import ForwardReport


def _sinks(config: Config, *, console: bool, correlator: bool = False) -> list[Sink]:
    """Every sink `watch` and `scan --notify` deliver to (console, Slack, Alertmanager); a
    [slack] that cannot work fails here. A node in fleet mode leaves Slack and Alertmanager to
    `nanwatch fleet` (``correlator``), unless [fleet] notify_locally says otherwise."""
    from ..notify.console import ConsoleSink

    sinks: list[Sink] = []
    if console:
        sinks.append(ConsoleSink())
    if config.fleet.dsn and not correlator and not config.fleet.notify_locally:
        return sinks
    if config.slack.enabled:
        from ..notify.slack import SlackSink, slack_settings

        settings = slack_settings(config)
        if settings is not None:
            sinks.append(SlackSink(settings, config.alerts, config_path=config.path))
    if config.alertmanager.urls:
        from ..notify.alertmanager import AlertmanagerSink
        from ..sources.identity import this_node

        sinks.append(
            AlertmanagerSink(config.alertmanager.urls, node=this_node(config.cluster.node))
        )
    return sinks


def _forward(config: Config, store: Store) -> ForwardReport | None:
    """Fleet mode: what this scan committed goes to the fleet store; unreachable is not an
    error of the scan (the events wait in this database for the next forward)."""
    if not config.fleet.dsn:
        return None
    from ..notify.forward import Forwarder
    from ..sources.identity import this_node

    fwd = Forwarder(config, node=this_node(config.cluster.node))
    try:
        return fwd.forward(store, now=time.time())
    finally:
        fwd.close()


@click.command()
@config_option
@db_option
@click.option("--run", "run", default=None, help="Put everything in one run with this name.")
@click.option("--quiet", is_flag=True, help="Do not print incidents to stdout.")
@verbosity_option
@click.argument("paths", nargs=-1, type=click.Path(path_type=str))
@handle_errors
def watch(
    config_path: Path | None,
    db: Path | None,
    run: str | None,
    quiet: bool,
    verbose: int,
    paths: tuple[str, ...],
) -> None:
    """Follow training logs, plogs and msprobe monitor output until stopped.

    PATHs are files, folders (every text file below them, recursively, new ones included) or
    globs; without PATH, `[sources] paths` from the config. Each PATH is one run. Offsets are
    committed with the events, so a restart resumes exactly where it stopped. SIGTERM or
    Ctrl-C stop it cleanly (everything read is committed; exit status 0); SIGHUP reloads the
    config (sources, rules, notifications, retention, metrics) without losing offsets, and a
    config that does not validate is logged and the running one kept.

    Under systemd (Type=notify) it reports readiness, status and watchdog pings on
    $NOTIFY_SOCKET; see systemd/nanwatch.service and `nanwatch doctor`.

    \b
    Examples:
      nanwatch watch work_dirs/dino/
      nanwatch watch --config /etc/nanwatch/nanwatch.toml
      nanwatch watch --db /tmp/nw.db '/data/logs/*/rank*.log'
      systemctl reload nanwatch        # SIGHUP: re-read the config
    """
    from ..daemon.service import Service, setup_logging

    setup_logging(verbose)
    try:
        Service(
            config_path=config_path,
            db=db,
            paths=paths,
            run=run,
            make_sinks=lambda config: _sinks(config, console=not quiet),
        ).run()
    except NanwatchError as e:
        # a bad config, a damaged or locked database: restarting will not fix it
        click.echo(f"nanwatch: error: {e}", err=True)
        sys.exit(EXIT_UNFIXABLE)


@click.command()
@config_option
@db_option
@click.option("--run", "run", default=None, help="Put everything in one run with this name.")
@click.option(
    "--notify",
    is_flag=True,
    help="Deliver the incidents' notifications (Slack, ...) before exiting.",
)
@click.option(
    "--notify-timeout",
    "notify_timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    metavar="SECONDS",
    help="With --notify: stop delivering after this long; what is left stays in the outbox "
    "for `nanwatch watch`.",
)
@click.option(
    "--fail-on",
    "fail_on",
    multiple=True,
    metavar="KIND",
    help="Exit with status 3 if an incident of this kind (or 'any') was found.",
)
@json_option
@verbosity_option
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@handle_errors
def scan(
    config_path: Path | None,
    db: Path | None,
    run: str | None,
    notify: bool,
    notify_timeout: float,
    fail_on: tuple[str, ...],
    as_json: bool,
    verbose: int,
    paths: tuple[str, ...],
) -> None:
    """Ingest log files or folders once, correlate them, and print what was found.

    Same code path as `watch`. Scanning the same files again adds nothing (offsets are kept).
    Without --notify nothing is queued for Slack, so a later `watch` never posts old incidents.
    Exit status 0 whatever was found; use --fail-on KIND for a verdict.

    \b
    Examples:
      nanwatch scan work_dirs/dino/20261130_101500/
      nanwatch scan --json /data/logs/job42/ | jq .incidents
      nanwatch scan --fail-on nan --fail-on oom logs/
    """
    setup_logging(verbose, quiet_default=True)
    config, db_path = resolve(config_path, db)
    from ..daemon.pipeline import Pipeline
    from ..query import list_incidents
    from ..render import render_incident_line
    from ..store import Store
    from ..store.runs import Runs

    store = Store.open(db_path)
    try:
        started = time.monotonic()
        sinks = _sinks(config, console=False) if notify else []
        pipe = Pipeline(config, store, list(paths), run=run, live=False, sinks=sinks)
        total, nfiles = tree_size(list(paths))
        bar = Progress(total, "Scanning", enabled=not as_json)
        pipe.on_progress = lambda: bar.update(pipe.stats.bytes, len(pipe.tracker.records))
        try:
            pipe.scan()
            bar.update(total, nfiles)
        finally:
            bar.close()
        undelivered = pipe.deliver_all(deadline=notify_timeout) if notify else 0
        forwarded = _forward(config, store)
        elapsed = time.monotonic() - started
        runs = pipe.run_ids()
        names = Runs(store).names_of(list(runs))
        incidents = [i for name in names for i in list_incidents(store, run=name)]
        summary = {
            "database": str(db_path),
            "files": len(pipe.tracker.records),
            "bytes": pipe.stats.bytes,
            "seconds": round(elapsed, 3),
            "events": dict(pipe.stats.events),
            "metrics": pipe.stats.metrics,
            "runs": names,
            "incidents": incidents,
            "undelivered": undelivered,
            "counters": pipe.counters(),
        }
        if forwarded is not None:
            summary["fleet"] = {
                "forwarded": forwarded.events,
                "waiting": forwarded.waiting,
                "error": forwarded.error,
            }
        if as_json:
            emit_json(summary)
        else:
            mb = pipe.stats.bytes / 1e6
            ev = ", ".join(f"{k} {v}" for k, v in sorted(pipe.stats.events.items())) or "none"
            click.echo(
                f"Scanned {summary['files']} file(s), {mb:.1f} MB in {elapsed:.2f}s: "
                f"new events: {ev}; {pipe.stats.metrics} metric rows."
            )
            click.echo(f"Runs: {', '.join(names) or '-'}   database: {db_path}")
            if incidents:
                click.echo(f"{len(incidents)} incident(s):")
                for inc in incidents:
                    click.echo("  " + render_incident_line(inc))
                click.echo("See `nanwatch show ID` for the story.")
            else:
                click.echo("No incidents.")
        if forwarded is not None and forwarded.error:
            click.echo(
                f"nanwatch: {forwarded.error}; {forwarded.waiting} event(s) wait to be "
                "forwarded: the next scan or `nanwatch watch` on this database sends them.",
                err=True,
            )
        if undelivered:
            click.echo(
                f"{undelivered} notification(s) not delivered within {notify_timeout:g}s are "
                "left in the outbox: `nanwatch watch` on this database delivers them.",
                err=True,
            )
        wanted = set(fail_on)
        if wanted and any("any" in wanted or i["kind"] in wanted for i in incidents):
            sys.exit(EXIT_VERDICT)
    finally:
        store.close()
