"""`nanwatch rules` and `nanwatch explain`: the detection rules, and what they make of a line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ._common import EXIT_ERROR, config_option, emit_json, handle_errors, json_option


def _load(config_path: Path | None, extra: tuple[Path, ...] = (), check: bool = True) -> Any:
    from ..config import load_config
    from ..detect import load_rules

    config = load_config(config_path)
    extra_dirs = {p.resolve() for p in extra}
    site = [d for d in config.detect.rule_dirs if Path(d).resolve() not in extra_dirs]
    return load_rules([*extra, *site], check=check)


@click.command()
@config_option
@click.option("--pack", default=None, help="Only the rules of this pack.")
@click.option("--kind", default=None, help="Only rules giving this event kind.")
@click.option(
    "--check",
    "check_dirs",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="DIR",
    help="Run every example of the packs in DIR (and of the site and shipped packs); "
    "exit 1 naming each example that fails. Repeatable.",
)
@json_option
@handle_errors
def rules(
    config_path: Path | None,
    pack: str | None,
    kind: str | None,
    check_dirs: tuple[Path, ...],
    as_json: bool,
) -> None:
    """List the detection rules: shipped packs and the site packs of `[detect] rule_dirs`.

    A broken site pack is an error naming its file, the rule id and the reason; so is a site
    rule whose own examples it does not match. `--check DIR` runs the examples of a pack
    folder before it goes into `rule_dirs`: every example must give its event, state, metrics
    or facts through the rule it belongs to (not through another rule that happens to match).
    It also runs the shipped examples, so it shows a site rule that takes their lines.

    \b
    Examples:
      nanwatch rules
      nanwatch rules --kind comm_timeout
      nanwatch rules --json --config /etc/nanwatch/nanwatch.toml
      nanwatch rules --check ./our-packs
    """
    if check_dirs:
        _check(config_path, check_dirs, as_json)
        return
    rs = _load(config_path)
    rows = []
    for p in rs.prefixes:
        rows.append(
            {
                "id": p.id,
                "pack": p.pack,
                "type": "prefix",
                "kind": None,
                "tier": None,
                "literals": [],
                "pattern": p.pattern,
                "examples": len(p.examples),
                "source": str(p.source),
            }
        )
    for r in rs.rules:
        rows.append(
            {
                "id": r.id,
                "pack": r.pack,
                "type": "hint" if r.hint else r.type,
                "kind": r.kind,
                "tier": r.tier if r.type == "event" else None,
                "literals": list(r.literals),
                "pattern": r.pattern,
                "chunk": r.chunk,
                "lines": r.lines,
                "incident": r.const.get("incident", True) if r.type == "event" else None,
                "examples": len(r.examples),
                "source": str(r.source),
            }
        )
    if pack:
        rows = [r for r in rows if r["pack"] == pack]
    if kind:
        rows = [r for r in rows if r["kind"] == kind]
    if as_json:
        for row in rows:
            emit_json(row)
        return
    from ..render import table

    click.echo(
        table(
            [
                (
                    r["id"],
                    r["type"] + (" (chunk)" if r.get("chunk") else ""),
                    r["kind"] or "",
                    r["tier"] or "",
                    r["examples"],
                )
                for r in rows
            ],
            ["rule", "type", "kind", "tier", "examples"],
        )
    )
    click.echo(f"\n{len(rows)} rules from {len(rs.packs)} packs")


def _check(config_path: Path | None, dirs: tuple[Path, ...], as_json: bool) -> None:
    from ..detect.examples import check_examples

    rs = _load(config_path, dirs, check=False)
    failures = check_examples(rs)
    total = sum(len(x.examples) for x in [*rs.prefixes, *rs.rules])
    for f in failures:
        if as_json:
            emit_json(
                {"file": str(f.source), "rule": f.rule, "example": f.index, "problem": f.problem}
            )
        else:
            click.echo(str(f), err=True)
    if not as_json:
        click.echo(f"{total - len(failures)} of {total} examples pass ({len(rs.packs)} packs)")
    if failures:
        sys.exit(EXIT_ERROR)


@click.command()
@config_option
@json_option
@click.argument("text", metavar="LINE")
@handle_errors
def explain(config_path: Path | None, as_json: bool, text: str) -> None:
    """Show which rules match LINE and the event(s) it gives.

    LINE may hold several lines (a traceback, an error block); `-` reads them from stdin.
    Useful when writing a site pack: put it in a `[detect] rule_dirs` folder and pass --config.

    \b
    Examples:
      nanwatch explain '[rank3]: RuntimeError: CUDA error: out of memory'
      tail -n 40 rank3.log | nanwatch explain -
      nanwatch explain --json 'loss: nan'
    """
    rs = _load(config_path)
    from ..detect import Detector

    if text == "-":
        text = sys.stdin.read()
    result = Detector(rs).explain(text)
    if as_json:
        emit_json(result)
        return
    if not result["matches"]:
        click.echo("No rule matches.")
    for m in result["matches"]:
        what = m["type"] + (f" {m['kind']}" if m.get("kind") else "")
        click.echo(f"{m['rule']}  ({what}, pack {m['pack']})")
        for k, v in m["values"].items():
            click.echo(f"    {k} = {v!r}")
    for ev in result["events"]:
        click.echo(f"\nevent: {ev['kind']}  {ev['message']}")
        for k in ("rank", "local_rank", "node", "stage", "epoch", "iter", "step", "device", "time"):
            if ev.get(k) is not None:
                click.echo(f"    {k} = {ev[k]!r}")
        for k, v in ev["fields"].items():
            click.echo(f"    fields.{k} = {v!r}")
    if result["metrics"]:
        click.echo(f"\nmetrics: {len(result['metrics'])} logged iteration(s)")
    from ..detect.examples import flatten

    for k, v in flatten(result.get("facts") or {}).items():
        click.echo(f"run fact: {k} = {v!r}")
