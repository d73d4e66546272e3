"""`nanwatch notify-test`, `silence`, `silences` and `plot`: the notification side of the CLI."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import ConfigError, NanwatchError
from ._common import (
    EXIT_ERROR,
    config_option,
    db_option,
    emit_json,
    find_db,
    handle_errors,
    json_option,
    open_reader,
    resolve,
)


@click.command("notify-test")
@config_option
@json_option
@handle_errors
def notify_test(config_path: Path | None, as_json: bool) -> None:
    """Send a test message through the [slack] configuration and print Slack's answers.

    With a bot token: auth.test (which workspace and bot the token is), then for each channel
    (`channel` and every route) conversations.info when it is an ID, and a test message.
    With an incoming webhook: one test message. Exit status 1 if any step failed.

    \b
    Examples:
      nanwatch notify-test --config /etc/nanwatch/nanwatch.toml
      SLACK_BOT_TOKEN=... nanwatch notify-test --config nanwatch.toml --json
    """
    from ..notify.slack_api import self_test, slack_settings

    config, _ = resolve(config_path, None)
    settings = slack_settings(config)
    if settings is None:
        raise ConfigError(
            f"{config.path or 'no --config given'}: no [slack] section; add one with channel and "
            "token_file (or webhook_url_file) to send notifications to Slack"
        )
    steps = self_test(settings)
    if as_json:
        for step in steps:
            emit_json(step)
    else:
        click.echo(f"Slack ({settings.mode}, secret from {settings.secret_source}):")
        for step in steps:
            where = f" {step['channel']}" if step.get("channel") else ""
            if step["ok"]:
                answer = step.get("answer")
                if isinstance(answer, dict):
                    answer = ", ".join(f"{k}={v}" for k, v in answer.items() if v is not None)
                click.echo(f"  ok    {step['step']}{where}: {answer}")
            else:
                click.echo(f"  FAIL  {step['step']}{where}: {step.get('detail') or step['error']}")
    if not all(s["ok"] for s in steps):
        sys.exit(EXIT_ERROR)


@click.command()
@config_option
@db_option
@click.option("--run", "run", default=None, help="Silence this run (name as `nanwatch runs`).")
@click.option("--kind", "kind", default=None, help="Silence this incident kind (nan, oom, ...).")
@click.option(
    "--for", "duration", default="2h", show_default=True, help="How long: 30m, 2h, 1d, ..."
)
@click.option("--comment", default=None, help="Why (shown by `nanwatch silences`).")
@json_option
@handle_errors
def silence(
    config_path: Path | None,
    db: Path | None,
    run: str | None,
    kind: str | None,
    duration: str,
    comment: str | None,
    as_json: bool,
) -> None:
    """Hold notifications (Slack, ...) of a run and/or kind for a while.

    Messages are held, not dropped: when the silence ends, incidents that are still open are
    announced with their state at that time. Incidents are still detected and stored.

    \b
    Examples:
      nanwatch silence --run dino/20261130_101500 --for 2h --comment "known bad data"
      nanwatch silence --kind slowdown --for 1d
      nanwatch silence --run job42 --kind comm_timeout --for 30m
    """
    from ..config import parse_duration
    from ..events import KINDS
    from ..notify.silences import add_silence
    from ..store import Store

    if run is None and kind is None:
        raise click.UsageError("say what to silence: --run RUN, --kind KIND, or both")
    if kind is not None and kind not in KINDS:
        raise click.UsageError(f"--kind {kind!r}: unknown kind; one of {', '.join(KINDS)}")
    try:
        seconds = parse_duration(duration, where="--for")
    except NanwatchError as e:
        raise click.UsageError(str(e)) from None
    if seconds <= 0:
        raise click.UsageError("--for: must be longer than zero")
    _, db_path, origin = find_db(config_path, db)
    if origin is not None and not as_json:
        click.echo(f"nanwatch: database {db_path} ({origin})", err=True)
    store = Store.open(db_path, exclusive=False)  # works while `watch` runs
    try:
        if run is not None and store.run_by_name(run) is None:
            click.echo(
                f"nanwatch: note: no run named {run!r} yet; the silence applies when one appears",
                err=True,
            )
        s = add_silence(store, run=run, kind=kind, seconds=seconds, comment=comment)
    finally:
        store.close()
    if as_json:
        emit_json(s)
    else:
        what = " ".join(
            x for x in (f"run {run}" if run else "", f"kind {kind}" if kind else "") if x
        )
        click.echo(f"Silence {s['id']}: {what} until {s['until_utc']}.")


@click.command()
@config_option
@db_option
@click.option("--all", "show_all", is_flag=True, help="Include expired silences.")
@json_option
@handle_errors
def silences(config_path: Path | None, db: Path | None, show_all: bool, as_json: bool) -> None:
    """List silences (active ones; --all for expired too).

    \b
    Examples:
      nanwatch silences
      nanwatch silences --all --json
    """
    from ..notify.silences import list_silences
    from ..render import table

    store = open_reader(config_path, db, quiet=as_json)
    try:
        rows = list_silences(store, include_expired=show_all)
    finally:
        store.close()
    if as_json:
        for r in rows:
            emit_json(r)
        return
    if not rows:
        click.echo("No active silences." if not show_all else "No silences.")
        return
    click.echo(
        table(
            [
                (
                    r["id"],
                    r["run"] or "*",
                    r["kind"] or "*",
                    r["until_utc"],
                    "yes" if r["active"] else "expired",
                    r["comment"] or "",
                )
                for r in rows
            ],
            ["id", "run", "kind", "until", "active", "comment"],
        )
    )


@click.command()
@config_option
@db_option
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="PNG file to write.",
)
@click.argument("incident_id", type=int)
@handle_errors
def plot(config_path: Path | None, db: Path | None, output: Path, incident_id: int) -> None:
    """Draw loss, grad norm and step time per rank around an incident, its origin marked.

    Needs matplotlib (pip install 'nanwatch[plot]'). The origin rank is in colour, the other
    ranks thin and grey; non-finite values are red crosses at the top of their panel; the
    origin's step is a dashed red line. A slowdown is drawn beside its baseline run, with both
    medians as lines; an out-of-memory incident gets a memory panel on a time axis, validation
    shaded. Slack threads get the same picture.

    \b
    Examples:
      nanwatch plot 3 -o incident3.png
      nanwatch plot 3 -o /tmp/nan.png --db /var/lib/nanwatch/nanwatch.db
    """
    from ..notify.plot import metrics_for, render_png
    from ..notify.view import load_incident
    from ..store.outbox import OutboxStore

    store = open_reader(config_path, db)
    try:
        inc = load_incident(OutboxStore(store), incident_id)
        if inc is None:
            raise NanwatchError(
                f"no incident {incident_id} in {store.path}; see `nanwatch incidents`"
            )
        rows = metrics_for(store, inc)
    finally:
        store.close()
    png = render_png(inc, rows)
    try:
        output.write_bytes(png)
    except OSError as e:
        raise NanwatchError(f"{output}: cannot write the picture ({e.strerror})") from None
    ranks = {r.rank for r in rows if r.series == "current"}
    click.echo(f"Wrote {output} ({len(png)} bytes, {len(ranks)} rank(s)).")
