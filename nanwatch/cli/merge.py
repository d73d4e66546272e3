"""`nanwatch merge`: node databases into one fleet database."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from pathlib import Path

import click

from ._common import config_option, emit_json, handle_errors, json_option, resolve
from ._progress import Progress


@click.command()
@config_option
@json_option
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument(
    "nodes", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path)
)
@handle_errors
def merge(config_path: Path | None, as_json: bool, out: Path, nodes: tuple[Path, ...]) -> None:
    """Merge node databases (NODE.db...) into OUT (created if missing), then correlate them.

    Each node's daemon keeps its own database; the merged one answers `incidents` and `show`
    across the fleet. Runs of the same job and run (the `job`/`run` labels every node derives)
    become one run, so the rank that failed on node A absorbs the timeouts it caused on node B;
    a run known only by its local name stays its node's (`NAME@NODE`). Events, runs and sources
    keep their node. Merging the same database again adds only what it gained since; a fleet
    incident is resolved once every node incident it was built from is. Copy a live node
    database with `sqlite3 nanwatch.db ".backup node-a.db"` (or merge it in place: it is only
    read). The config gives the knowledge base and collective timeouts for correlating.

    \b
    Examples:
      nanwatch merge fleet.db node-a.db node-b.db
      nanwatch merge fleet.db node-*.db && nanwatch incidents --db fleet.db
      nanwatch merge --json fleet.db node-c.db | jq .incidents
    """
    from ..correlate import Correlator
    from ..correlate.chains import Timeouts
    from ..correlate.knowledge import Knowledge
    from ..errors import StoreError
    from ..query import list_incidents
    from ..render import render_incident_line
    from ..store import Store
    from ..store.merge import carry_over_resolutions, merge_database

    config, _ = resolve(config_path, out)
    out_resolved = out.resolve()
    for n in nodes:
        if n.resolve() == out_resolved:
            raise StoreError(f"{n}: this is the output database itself; name another one")
    store = Store.open(out)
    try:
        reports = []
        sizes = [p.stat().st_size for p in nodes]
        bar = Progress(sum(sizes), "Merging", enabled=not as_json, unit="database(s)")
        try:
            for k, path in enumerate(nodes):
                src = Store.open(path, readonly=True)
                try:
                    reports.append(merge_database(store, src, path=str(path)))
                finally:
                    src.close()
                bar.update(sum(sizes[: k + 1]), k + 1)
        finally:
            bar.close()
        correlator = Correlator(
            store,
            timeouts=Timeouts(config.knowledge.hccl_exec_timeout, config.knowledge.nccl_timeout),
            knowledge=Knowledge.load(
                config.knowledge.dirs, cann_version=config.knowledge.cann_version
            ),
        )
        changes = correlator.process(live=False)
        resolved = carry_over_resolutions(store)
        incidents = list_incidents(store)
    finally:
        store.close()
    if as_json:
        emit_json(
            {
                "database": str(out),
                "merged": [asdict(r) for r in reports],
                "changes": len(changes),
                "resolved": [iid for iid, _ in resolved],
                "incidents": incidents,
            }
        )
        return
    for r in reports:
        click.echo(
            f"{r.path}: node {', '.join(r.nodes) or '-'}: {r.events} new event(s), "
            f"{r.metrics} metric row(s), {r.sources} file(s), {r.runs} run(s)"
        )
    if incidents:
        click.echo(f"{out}: {len(incidents)} incident(s):")
        for inc in incidents:
            nodes_text = ",".join(inc["nodes"]) or "-"
            click.echo(f"  {render_incident_line(inc)} [nodes {nodes_text}]")
        click.echo(f"See `nanwatch show ID --db {shlex.quote(str(out))}` for the story.")
    else:
        click.echo(f"{out}: no incidents.")
