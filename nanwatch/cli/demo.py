"""`nanwatch demo`: a multi-rank training run goes wrong while `watch` follows it."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import click

from ._common import handle_errors, setup_logging


@click.command()
@click.option(
    "--speed",
    type=float,
    default=4.0,
    show_default=True,
    help="How much faster than real time the run is replayed.",
)
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the run and the database (default: a new temporary folder).",
)
@click.option("-v", "--verbose", count=True, help="Show the daemon's log lines too.")
@handle_errors
def demo(speed: float, directory: Path | None, verbose: int) -> None:
    """Replay an 8-rank mmengine (DINO) training whose loss turns NaN on rank 6 first, while
    `watch` follows it on a fresh database in a temporary folder (never your own database).

    Incidents are printed as they are detected; at the end `nanwatch incidents` is shown,
    with the commands to explore the database further.

    \b
    Example:
      nanwatch demo
    """
    setup_logging(verbose, quiet_default=True)
    from ..config import Config
    from ..notify.console import ConsoleSink
    from ..pipeline import Pipeline
    from ..query import list_incidents
    from ..render import origin_text, ranks_text, table
    from ..simulate import TrainingRun
    from ..store import Store

    base = directory or Path(tempfile.mkdtemp(prefix="nanwatch-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    db_path = base / "nanwatch.db"
    work_dir = base / "work_dirs" / "dino-4scale_r50_8xb2-12e_coco"
    run = TrainingRun(work_dir)
    run.launch_dir.mkdir(parents=True, exist_ok=True)
    click.echo(f"nanwatch demo: database {db_path}")
    click.echo(f"nanwatch demo: replaying an 8-rank run into {run.launch_dir} ({speed:g}x)")

    store = Store.open(db_path)
    stop = threading.Event()
    ready = threading.Event()
    pipe = Pipeline(Config(), store, [str(work_dir)], live=True, sinks=[ConsoleSink()])
    watcher = threading.Thread(
        target=pipe.watch, args=(stop,), kwargs={"on_ready": ready.set}, name="nanwatch-watch"
    )
    watcher.start()
    try:
        ready.wait(30)
        run.replay(speed=speed)
        # let the daemon see the last lines and print what it found
        deadline = time.monotonic() + 10
        expected = sum(1 for _ in run.lines())
        while time.monotonic() < deadline:
            got = store_lines(db_path)
            if got >= expected:
                break
            time.sleep(0.2)
        time.sleep(0.5)
    finally:
        pipe.request_stop()
        watcher.join(30)
        store.close()

    reader = Store.open(db_path, readonly=True)
    try:
        incidents = list_incidents(reader.conn)
    finally:
        reader.close()
    click.echo("\n$ nanwatch incidents")
    if incidents:
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
                        origin_text(i["origin"]),
                    )
                    for i in incidents
                ],
                ["ID", "STATUS", "KIND", "RUN", "RANKS", "EVENTS", "ORIGIN"],
            )
        )
    else:
        click.echo("No incidents.")
    click.echo(
        f"\nExplore it:\n  nanwatch incidents --json --db {db_path}\n"
        f"  nanwatch show 1 --db {db_path}\n  nanwatch events --kind nan --db {db_path}"
    )


def store_lines(db_path: Path) -> int:
    """Lines the daemon has committed so far (sum of the sources' line counters)."""
    import json
    import sqlite3

    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        total = 0
        for (ctx,) in conn.execute("SELECT ctx FROM sources"):
            total += int(json.loads(ctx or "{}").get("line_no", 0))
        return total
    except sqlite3.Error:
        return 0
    finally:
        conn.close()
