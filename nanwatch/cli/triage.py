"""`nanwatch ack` and `nanwatch resolve`: a person's word on an incident."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import config_option, db_option, emit_json, find_db, handle_errors, json_option


def _run(
    action: str,
    config_path: Path | None,
    db: Path | None,
    incident_id: int,
    note: str | None,
    as_json: bool,
) -> None:
    from ..notify import triage
    from ..notify.view import load_incident
    from ..store import Store
    from ..store.outbox import OutboxStore

    _, path, _origin = find_db(config_path, db)
    if not path.exists():
        raise click.UsageError(f"{path}: no database here; pass --db FILE or --config FILE")
    store = Store.open(path, exclusive=False)  # one short transaction: works while `watch` runs
    try:
        fn = triage.acknowledge if action == "ack" else triage.resolve
        news = fn(store, incident_id, by=triage.who(), note=note)
        inc = load_incident(OutboxStore(store), incident_id)
    finally:
        store.close()
    if as_json:
        emit_json(inc or {})
    else:
        click.echo(f"#{incident_id}: {news}.")


@click.command()
@config_option
@db_option
@click.option("--note", default=None, help="Why, or what you are doing about it.")
@json_option
@click.argument("incident_id", type=int)
@handle_errors
def ack(
    config_path: Path | None, db: Path | None, note: str | None, as_json: bool, incident_id: int
) -> None:
    """Acknowledge an open incident: you are on it. Records who ($SUDO_USER, else $USER) and
    when with the incident; `show`, --json and the Slack message say so.

    \b
    Examples:
      nanwatch ack 3
      sudo nanwatch ack 3 --note 'looking at rank 6'
    """
    _run("ack", config_path, db, incident_id, note, as_json)


@click.command()
@config_option
@db_option
@click.option("--note", default=None, help="What fixed it, or why it needs no fix.")
@json_option
@click.argument("incident_id", type=int)
@handle_errors
def resolve(
    config_path: Path | None, db: Path | None, note: str | None, as_json: bool, incident_id: int
) -> None:
    """Resolve an open incident by hand. Records who and when; the Slack message is updated.
    A recurrence later opens a new incident.

    \b
    Examples:
      nanwatch resolve 3 --note 'CANN upgraded to 8.0.0'
      nanwatch resolve 3 --json
    """
    _run("resolve", config_path, db, incident_id, note, as_json)
