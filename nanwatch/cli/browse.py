"""Querying the store: `incidents`, `show`, `events`, `runs`."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import NanwatchError
from ..store.records import JSON
from ._common import (
    config_option,
    emit_json,
    handle_errors,
    json_option,
    open_reader,
    out_color,
    out_width,
    read_db_option,
)
from ._filters import SINCE_HELP, UNTIL_HELP, check_filters, match_runs

Doc = dict[str, JSON]

RUN_HELP = (
    "Only this run: its name, a tail of it (20261130_101500 for dino/20261130_101500) "
    "or a glob ('dino/*')."
)


@click.command()
@config_option
@read_db_option
@click.option("--open", "open_only", is_flag=True, help="Only open incidents (--status open).")
@click.option(
    "--status",
    type=click.Choice(["open", "resolved"]),
    default=None,
    help="Only incidents in this state.",
)
@click.option("--run", default=None, help=RUN_HELP)
@click.option("--kind", default=None, help="Only this kind (nan, oom, comm_timeout, ...).")
@click.option("--rank", type=int, default=None, help="Only incidents this rank took part in.")
@click.option("--since", default=None, help=SINCE_HELP)
@click.option("--until", default=None, help=UNTIL_HELP)
@click.option("--limit", type=int, default=None, help="At most N incidents (the newest N).")
@json_option
@handle_errors
def incidents(
    config_path: Path | None,
    db: Path | str | None,
    open_only: bool,
    status: str | None,
    run: str | None,
    kind: str | None,
    rank: int | None,
    since: str | None,
    until: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List incidents, open and resolved, oldest first.

    Lines fit the terminal ($COLUMNS, else its width; no limit when piped): the run shows
    its distinguishing tail, times their short form, titles are cut (`show ID` has it all).

    \b
    Examples:
      nanwatch incidents
      nanwatch incidents --open --json
      nanwatch incidents --kind nan --since 2h
      nanwatch incidents --status resolved --rank 5
      nanwatch incidents --run 20261130_101500 --limit 5
      nanwatch incidents --since 2026-11-30 --until 2026-12-01T06:00
    """
    from ..query import list_incidents, run_names

    t0, t1 = check_filters(kind, limit, since, until)
    if open_only and status not in (None, "open"):
        raise click.UsageError(f"--open and --status {status} contradict each other: drop one")
    if isinstance(db, str):
        from . import _fleet_reads

        rows = _fleet_reads.incidents(
            db, config_path, status="open" if open_only else status, kind=kind, run=run,
            rank=rank, since=t0, until=t1, limit=limit,
        )  # fmt: skip
        _print_incidents(rows, as_json, open_only, status, run, kind, since, until, rank)
        return
    store = open_reader(config_path, db, quiet=as_json)
    try:
        runs = match_runs(run, run_names(store))
        rows = list_incidents(
            store,
            status="open" if open_only else status,
            runs=runs,
            kind=kind,
            rank=rank,
            since=t0,
            until=t1,
            limit=limit,
        )
    finally:
        store.close()
    _print_incidents(rows, as_json, open_only, status, run, kind, since, until, rank)


def _print_incidents(
    rows: list[Doc],
    as_json: bool,
    open_only: bool,
    status: str | None,
    run: str | None,
    kind: str | None,
    since: str | None,
    until: str | None,
    rank: int | None,
) -> None:
    from .tables import incidents_table

    if as_json:
        for inc in rows:
            emit_json(inc)
        return
    if not rows:
        given = (status, run, kind, since, until, "" if rank is None else str(rank))
        click.echo("No incidents." + _filtered(open_only, *given))
        return
    click.echo(incidents_table(rows, width=out_width(), color=out_color()))


def _filtered(open_only: bool, *given: str | None) -> str:
    return " (with these filters; drop them to see all)" if open_only or any(given) else ""


@click.command()
@config_option
@read_db_option
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
    config_path: Path | None,
    db: Path | str | None,
    max_events: int,
    as_json: bool,
    incident_id: int,
) -> None:
    """Tell one incident's story: root cause, origin, timeline across ranks, known causes.

    \b
    Examples:
      nanwatch show 3
      nanwatch show 3 --json | jq .origin
    """
    from ..query import show_incident
    from ..render import render_story

    if isinstance(db, str):
        from . import _fleet_reads

        inc: Doc | None = _fleet_reads.show(db, config_path, incident_id)
    else:
        store = open_reader(config_path, db, quiet=as_json)
        try:
            inc = show_incident(store, incident_id, max_events=None if as_json else max_events)
        finally:
            store.close()
    if inc is None:
        raise NanwatchError(f"no incident #{incident_id}; list them with `nanwatch incidents`")
    if as_json:
        emit_json(inc)
    else:
        click.echo(render_story(inc, color=out_color(), max_events=max_events))
        merged = inc.get("node_incidents") or []
        if merged:
            names = ", ".join(f"{m['node']}#{m['id']}" for m in merged)
            click.echo(f"Node incidents merged into it ({len(merged)}): {names}")


@click.command()
@config_option
@read_db_option
@click.option("--kind", default=None, help="Only this kind (nan, oom, comm_timeout, ...).")
@click.option("--run", default=None, help=RUN_HELP)
@click.option("--rank", type=int, default=None, help="Only events of this (global) rank.")
@click.option("--incident", type=int, default=None, help="Only events of this incident.")
@click.option("--since", default=None, help=SINCE_HELP)
@click.option("--until", default=None, help=UNTIL_HELP)
@click.option(
    "--grep",
    default=None,
    metavar="WORDS",
    help="Only events whose message has these words, in this order (whole words, any case; "
    "end one with * for a prefix). Uses the full-text index: fast on millions of events.",
)
@click.option("--limit", type=int, default=None, help="At most N events (the newest N).")
@json_option
@handle_errors
def events(
    config_path: Path | None,
    db: Path | str | None,
    kind: str | None,
    run: str | None,
    rank: int | None,
    incident: int | None,
    since: str | None,
    until: str | None,
    grep: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """List detected events, oldest first (all of them unless --limit).

    \b
    Examples:
      nanwatch events --kind nan
      nanwatch events --grep EI0002
      nanwatch events --grep 'CUDA out of memory' --since 1d
      nanwatch events --run dino/20261130_101500 --json --limit 100
      nanwatch events --run 20261130_101500 --since 30m
    """
    from ..query import iter_events, run_names
    from .tables import events_table

    t0, t1 = check_filters(kind, limit, since, until)
    if isinstance(db, str):
        from . import _fleet_reads

        found = _fleet_reads.events(
            db, config_path, kind=kind, rank=rank, grep=_check_grep(grep), limit=limit
        )
        if as_json:
            for e in found:
                emit_json(e)
        elif found:
            click.echo(events_table(found, width=out_width(), color=out_color()))
        else:
            click.echo("No events.")
        return
    store = open_reader(config_path, db, quiet=as_json)
    try:
        runs = match_runs(run, run_names(store))
        it = iter_events(
            store,
            kind=kind,
            runs=runs,
            rank=rank,
            incident=incident,
            since=t0,
            until=t1,
            grep=_check_grep(grep),
            limit=limit,
            newest=limit is not None,
        )
        if as_json:
            for e in it:
                emit_json(e)
            return
        rows = list(it)
    finally:
        store.close()
    if not rows:
        given = (
            kind,
            run,
            since,
            until,
            grep,
            str(incident or ""),
            "" if rank is None else str(rank),
        )
        click.echo("No events." + _filtered(False, *given))
        return
    click.echo(events_table(rows, width=out_width(), color=out_color()))


def _check_grep(text: str | None) -> str | None:
    # the index holds words (letters and digits): punctuation alone can never match
    if text is not None and not any(c.isalnum() for c in text):
        raise click.UsageError(f"--grep {text!r}: give at least one word to look for")
    return text


@click.command()
@config_option
@read_db_option
@json_option
@handle_errors
def runs(config_path: Path | None, db: Path | str | None, as_json: bool) -> None:
    """List runs: one per training launch, with their start, end, status and facts.

    STATUS is `failing` while the run has an open incident, `resolved` when all of its
    incidents are resolved, `ok` without any. START and END are its first and last logged
    times.

    \b
    Examples:
      nanwatch runs
      nanwatch runs --json | jq .facts
    """
    from ..query import list_runs
    from .tables import runs_table

    if isinstance(db, str):
        from . import _fleet_reads

        fleet_runs = _fleet_reads.runs(db, config_path)
        for r in fleet_runs:
            if as_json:
                emit_json(r)
            else:
                click.echo(f"{r['node']}  {r['name']}  job={r['job'] or '-'}  events={r['events']}")
        if not fleet_runs and not as_json:
            click.echo("No runs.")
        return
    store = open_reader(config_path, db, quiet=as_json)
    try:
        rows = list_runs(store)
    finally:
        store.close()
    if as_json:
        for r in rows:
            emit_json(r)
        return
    if not rows:
        click.echo("No runs.")
        return
    click.echo(runs_table(rows, width=out_width()))
