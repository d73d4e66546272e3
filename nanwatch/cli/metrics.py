"""`nanwatch metrics`: the logged iterations' numbers (loss, grad norm, step time, ...)."""

from __future__ import annotations

import csv
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path

import click

from ..store.metrics import Metrics
from ..store.records import MetricRow
from ._common import (
    config_option,
    db_option,
    emit_json,
    handle_errors,
    json_option,
    open_reader,
    out_width,
)
from ._filters import SINCE_HELP, UNTIL_HELP, check_limit, match_runs, parse_when

RUN_HELP = (
    "Only this run: its name, a tail of it (20261130_101500 for dino/20261130_101500) "
    "or a glob ('dino/*')."
)
# what --json and --csv print of a row, in this order (run_id/source_id are the store's own)
FIELDS = (
    "run",
    "rank",
    "epoch",
    "iter",
    "step",
    "stage",
    "time",
    "loss",
    "grad_norm",
    "step_time",
    "data_time",
    "lr",
    "memory",
    "offset",
)


def _record(m: MetricRow) -> dict[str, object]:
    d = asdict(m)
    return {k: d[k] for k in FIELDS}


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _table(rows: Iterable[MetricRow], width: int | None) -> Iterator[str]:
    from .tables import Column, fit

    cols = [
        Column("RUN", cut="start", cut_rank=1, min_width=8),
        Column("RANK"),
        Column("EPOCH", drop_rank=2),
        Column("ITER", drop_rank=1),
        Column("STEP"),
        Column("STAGE", drop_rank=3),
        Column("TIME", drop_rank=4),
        Column("LOSS"),
        Column("GRAD_NORM", drop_rank=5),
        Column("STEP_TIME"),
        Column("DATA_TIME", drop_rank=6),
        Column("LR", drop_rank=7),
        Column("MEMORY", drop_rank=8),
    ]
    cells = [[_cell(v) for v in list(_record(m).values())[:-1]] for m in rows]
    yield fit(cells, cols, width=width)


@click.command()
@config_option
@db_option
@click.option("--run", default=None, help=RUN_HELP)
@click.option("--rank", type=int, default=None, help="Only this rank.")
@click.option("--since", default=None, help=SINCE_HELP)
@click.option("--until", default=None, help=UNTIL_HELP)
@click.option("--limit", type=int, default=None, help="At most N iterations (the last N).")
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header line.")
@handle_errors
def metrics(
    config_path: Path | None,
    db: Path | None,
    run: str | None,
    rank: int | None,
    since: str | None,
    until: str | None,
    limit: int | None,
    as_json: bool,
    as_csv: bool,
) -> None:
    """List the metrics of every logged iteration: loss, grad norm, step time, data time,
    learning rate, memory; run by run, each file's iterations in the order they were logged
    (all of them unless --limit). --since/--until compare with the time the line printed.

    \b
    Examples:
      nanwatch metrics --run dino/20261130_101500 --rank 0
      nanwatch metrics --run 20261130_101500 --since 2h --json | jq .step_time
      nanwatch metrics --csv > steps.csv
    """
    if as_json and as_csv:
        raise click.UsageError("--json and --csv: choose one")
    check_limit(limit)
    t0, t1 = parse_when(since, "--since"), parse_when(until, "--until")
    store = open_reader(config_path, db, quiet=as_json or as_csv)
    try:
        metrics = Metrics(store)
        names = match_runs(run, metrics.run_names())
        it: Iterable[MetricRow] = metrics.rows(runs=names, rank=rank, since=t0, until=t1)
        if limit is not None:
            it = deque(it, maxlen=limit)
        if as_json:
            for m in it:
                emit_json(_record(m))
            return
        if as_csv:
            w = csv.writer(sys.stdout, lineterminator="\n")
            w.writerow(FIELDS)
            for m in it:
                w.writerow(["" if v is None else v for v in _record(m).values()])
            return
        got = list(it)
    finally:
        store.close()
    if not got:
        click.echo(
            "No metrics."
            + (
                " (filtered: try without --run/--rank/--since/--until)"
                if (run or rank is not None or since or until)
                else ""
            )
        )
        return
    for text in _table(got, out_width()):
        click.echo(text)
