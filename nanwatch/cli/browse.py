"""Querying the store: `incidents`, `show`, `events`, `runs`."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import NanwatchError
from ._common import config_option, db_option, emit_json, handle_errors, json_option, open_reader


@click.command()
@config_option
@db_option
@click.option("--open", "open_only", is_flag=True, help="Only open incidents.")
@click.option("--run", default=None, help="Only this run.")
@click.option("--kind", default=None, help="Only this kind (nan, oom, comm_timeout, ...).")
@json_option
@handle_errors
def incidents(
    config_path: Path | None,
    db: Path | None,
    open_only: bool,
    run: str | None,
    kind: str | None,
    as_json: bool,
) -> None:
    """List incidents, open and resolved, oldest first.

    \b
    Examples:
      nanwatch incidents
      nanwatch incidents --open --json
    """
    from ..query import list_incidents
    from ..render import origin_text, ranks_text, table

    store = open_reader(config_path, db)
    try:
        rows = list_incidents(store.conn, open_only=open_only, run=run, kind=kind)
    finally:
        store.close()
    if as_json:
        for inc in rows:
            emit_json(inc)
        return
    if not rows:
        click.echo("No incidents.")
        return
    click.echo(
        table(
            [
                (
                    i["id"],
                    i["status"],
                    i["kind"],
                    i["run"],
                    ranks_text(i["ranks"]),
                    i["event_count"],
                    i["first_time"] or "-",
                    origin_text(i["origin"]),
                    i["title"],
                )
                for i in rows
            ],
            ["ID", "STATUS", "KIND", "RUN", "RANKS", "EVENTS", "FIRST", "ORIGIN", "TITLE"],
            max_width=60,
        )
    )


@click.command()
@config_option
@db_option
@click.option(
    "--events",
    "max_events",
    type=int,
    default=20,
    show_default=True,
    help="How many of its events to list (the JSON form lists them all).",
)
@json_option
@click.argument("incident_id", type=int)
@handle_errors
def show(
    config_path: Path | None, db: Path | None, max_events: int, as_json: bool, incident_id: int
) -> None:
    """Tell one incident's story: root cause, origin, timeline across ranks, known causes.

    \b
    Examples:
      nanwatch show 3
      nanwatch show 3 --json | jq .origin
    """
    from ..query import show_incident
    from ..render import render_story

    store = open_reader(config_path, db)
    try:
        inc = show_incident(store.conn, incident_id, max_events=None if as_json else max_events)
    finally:
        store.close()
    if inc is None:
        raise NanwatchError(f"no incident #{incident_id}; list them with `nanwatch incidents`")
    if as_json:
        emit_json(inc)
    else:
        click.echo(render_story(inc, color=False, max_events=max_events))


@click.command()
@config_option
@db_option
@click.option("--kind", default=None, help="Only this kind.")
@click.option("--run", default=None, help="Only this run.")
@click.option("--incident", type=int, default=None, help="Only events of this incident.")
@click.option("--limit", type=int, default=None, help="At most N events (the newest N).")
@json_option
@handle_errors
def events(
    config_path: Path | None,
    db: Path | None,
    kind: str | None,
    run: str | None,
    incident: int | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List detected events, oldest first (all of them unless --limit).

    \b
    Examples:
      nanwatch events --kind nan
      nanwatch events --run dino/20261130_101500 --json --limit 100
    """
    from ..query import iter_events
    from ..render import table

    store = open_reader(config_path, db)
    try:
        it = iter_events(
            store.conn, kind=kind, run=run, incident=incident, limit=limit, newest=limit is not None
        )
        if as_json:
            for e in it:
                emit_json(e)
            return
        rows = [
            (
                e["id"],
                e["time"] or "-",
                e["kind"],
                e["run"],
                "-" if e["rank"] is None else e["rank"],
                e["stage"] or "-",
                "-" if e["epoch"] is None else e["epoch"],
                "-" if e["iter"] is None else e["iter"],
                "-" if e["step"] is None else e["step"],
                e["message"],
            )
            for e in it
        ]
    finally:
        store.close()
    if not rows:
        click.echo("No events.")
        return
    click.echo(
        table(
            rows,
            ["ID", "TIME", "KIND", "RUN", "RANK", "STAGE", "EPOCH", "ITER", "STEP", "MESSAGE"],
            max_width=70,
        )
    )


@click.command()
@config_option
@db_option
@json_option
@handle_errors
def runs(config_path: Path | None, db: Path | None, as_json: bool) -> None:
    """List runs: one per training launch, with their experiment and facts.

    \b
    Examples:
      nanwatch runs
      nanwatch runs --json | jq .facts
    """
    from ..query import list_runs
    from ..render import table

    store = open_reader(config_path, db)
    try:
        rows = list_runs(store.conn)
    finally:
        store.close()
    if as_json:
        for r in rows:
            emit_json(r)
        return
    if not rows:
        click.echo("No runs.")
        return
    click.echo(
        table(
            [
                (
                    r["id"],
                    r["name"],
                    r["experiment"] or "-",
                    r["sources"],
                    r["events"],
                    r["incidents"],
                    r["path"],
                )
                for r in rows
            ],
            ["ID", "RUN", "EXPERIMENT", "FILES", "EVENTS", "INCIDENTS", "PATH"],
        )
    )
