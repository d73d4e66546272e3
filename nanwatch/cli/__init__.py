"""The `nanwatch` command. Subcommands load lazily so `nanwatch --help` starts fast."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from .. import __version__

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "watch": ("ingest", "watch", "Follow logs and monitor output; detect, store, notify (daemon)."),
    "scan": ("ingest", "scan", "Ingest files or folders once, correlate, print a summary."),
    "incidents": ("browse", "incidents", "List incidents (open and resolved)."),
    "show": ("browse", "show", "Tell one incident's story: root cause, timeline, hints."),
    "events": ("browse", "events", "List detected events, oldest first."),
    "runs": ("browse", "runs", "List runs (one training launch each) and their facts."),
    "metrics": ("metrics", "metrics", "List logged iterations: loss, grad norm, step time..."),
    "ack": ("triage", "ack", "Acknowledge an incident: who is on it, since when."),
    "resolve": ("triage", "resolve", "Resolve an incident by hand, with a note."),
    "demo": ("demo", "demo", "Replay a multi-rank training run that goes wrong, live."),
    "check-dataset": (
        "dataset",
        "check_dataset",
        "List COCO images whose ground truth will be empty after filtering.",
    ),
    "notify-test": ("notify", "notify_test", "Send a test message to Slack; print the answers."),
    "silence": ("notify", "silence", "Hold notifications of a run and/or kind for a while."),
    "silences": ("notify", "silences", "List silences."),
    "plot": ("notify", "plot", "Draw loss, grad norm, step time per rank around an incident."),
    "shapes": (
        "shapes",
        "shapes",
        "List a checkpoint's parameters of a shape, with their modules.",
    ),
    "rules": ("rules", "rules", "List the detection rules (shipped and site packs)."),
    "explain": ("rules", "explain", "Show which rules match a log line and the event it gives."),
    "doctor": ("doctor", "doctor", "Check this node can run the service; say how to fix it."),
    "merge": ("merge", "merge", "Merge node databases into one fleet database; correlate."),
    "fleet": ("fleet", "fleet", "Correlate every node of the fleet store (PostgreSQL); notify."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(f"{__name__}.{spec[0]}")
        cmd: click.Command = getattr(module, spec[1])
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nanwatch")
def cli() -> None:
    """nanwatch: watch distributed training runs for NaNs, OOMs, collective timeouts and
    slowdowns, and explain them.

    \b
    Quick start:
      nanwatch scan work_dirs/dino/            # ingest finished logs, print incidents
      nanwatch watch --config nanwatch.toml    # follow live runs (the daemon)
      nanwatch incidents                       # what went wrong
      nanwatch show 3                          # root cause, timeline, known causes

    Read commands open --db, else the `db` of --config/$NANWATCH_CONFIG, else $NANWATCH_DB,
    else the `db` of the service's /etc/nanwatch/nanwatch.toml, else
    ~/.local/state/nanwatch/nanwatch.db (and say on stderr which one when it is not yours).
    """


def main(argv: list[str] | None = None) -> Any:
    return cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="nanwatch")
