"""Shared CLI plumbing: options, config and store opening, error reporting."""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..config import Config, load_config
from ..errors import NanwatchError
from ..store import Store
from ..store.db import damaged, is_damage

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1
EXIT_VERDICT = 3
EXIT_UNFIXABLE = 78  # EX_CONFIG: `watch` could not start and a restart would not help


def db_option(f: F) -> F:
    return click.option(
        "--db",
        "db",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=(
            "Database file (default: $NANWATCH_DB, the config's `db`, or the per-user state path)."
        ),
    )(f)


def config_option(f: F) -> F:
    return click.option(
        "--config",
        "config_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=lambda: os.environ.get("NANWATCH_CONFIG"),
        help="TOML config file (default: $NANWATCH_CONFIG).",
    )(f)


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")(f)


def verbosity_option(f: F) -> F:
    return click.option("-v", "--verbose", count=True, help="More log output (-vv: debug).")(f)


def handle_errors(f: F) -> F:
    """Turn NanwatchError into a one-line message and exit status 1."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except NanwatchError as e:
            click.echo(f"nanwatch: error: {e}", err=True)
            sys.exit(EXIT_ERROR)
        except sqlite3.DatabaseError as e:
            # a query met a damaged page the bounded check at open did not reach
            if not is_damage(e):
                raise
            click.echo(f"nanwatch: error: {damaged(Store.last_opened or '?', str(e))}", err=True)
            sys.exit(EXIT_ERROR)
        except BrokenPipeError:
            # e.g. `nanwatch events | head`
            sys.stderr.close()
            sys.exit(0)

    return wrapper  # type: ignore[return-value]


def setup_logging(verbose: int, *, quiet_default: bool = False) -> None:
    level = logging.WARNING if quiet_default else logging.INFO
    if verbose == 1:
        level = logging.INFO
    elif verbose >= 2:
        level = logging.DEBUG
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )


def resolve(config_path: Path | None, db: Path | None) -> tuple[Config, Path]:
    config = load_config(config_path)
    return config, (db if db is not None else config.db_path())


def open_reader(config_path: Path | None, db: Path | None) -> Store:
    _, path = resolve(config_path, db)
    return Store.open(path, readonly=True)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False))
