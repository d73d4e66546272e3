"""Shared CLI plumbing: options, config and store opening, error reporting.

The config and the store load when a command first opens them, not when the options are
declared: `scan --help` and `watch --help` read neither.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import click

from ..errors import ConfigError, NanwatchError, StoreError

if TYPE_CHECKING:
    from ..config import Config
    from ..store import Store

F = TypeVar("F", bound=Callable[..., Any])  # a click option decorates any command
P = ParamSpec("P")
R = TypeVar("R")

EXIT_ERROR = 1
EXIT_VERDICT = 3
EXIT_UNFIXABLE = 78  # EX_CONFIG: `watch` could not start and a restart would not help


class _DbParam(click.ParamType):  # type: ignore[type-arg]
    """A database file (a Path), or a fleet store's postgresql:// DSN (kept as text)."""

    name = "FILE|DSN"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> object:
        if isinstance(value, str) and value.startswith(("postgresql://", "postgres://")):
            return value
        path = value if isinstance(value, Path) else str(value)
        return click.Path(dir_okay=False, path_type=Path).convert(path, param, ctx)


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


def read_db_option(f: F) -> F:
    """--db of the read commands: a node's file or the fleet store (PostgreSQL)."""
    return click.option(
        "--db",
        "db",
        type=_DbParam(),
        default=None,
        help=(
            "Database file (default: $NANWATCH_DB, the config's `db`, or the per-user state "
            "path), or the fleet store: postgresql://USER@HOST:PORT/DB (password from "
            "PGPASSWORD, ~/.pgpass or the config's [fleet] password_file, never in the URL)."
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


def handle_errors(f: Callable[P, R]) -> Callable[P, R]:
    """Turn NanwatchError into a one-line message and exit status 1."""

    @functools.wraps(f)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return f(*args, **kwargs)
        except NanwatchError as e:
            click.echo(f"nanwatch: error: {e}", err=True)
            sys.exit(EXIT_ERROR)
        except BrokenPipeError:
            # e.g. `nanwatch events | head`
            sys.stderr.close()
            sys.exit(0)
        except Exception as e:
            # a query met a damaged page the bounded check at open did not reach (the store
            # knows SQLite's words for it: this module has no business with sqlite3)
            from ..store import Store
            from ..store.db import damaged, is_damage

            if not is_damage(e):
                raise
            click.echo(f"nanwatch: error: {damaged(Store.last_opened or '?', str(e))}", err=True)
            sys.exit(EXIT_ERROR)

    return wrapper


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
    from ..config import load_config

    config = load_config(config_path)
    return config, (db if db is not None else config.db_path())


# The service's config (systemd/nanwatch.service passes it to `watch`); a module constant so
# tests can point it elsewhere.
SYSTEM_CONFIG = Path("/etc/nanwatch/nanwatch.toml")


def find_db(config_path: Path | None, db: Path | None) -> tuple[Config, Path, str | None]:
    """The database read commands use, the way the service finds it, and where that came from
    (None for --db and the per-user default): --db; the `db` of --config/$NANWATCH_CONFIG;
    $NANWATCH_DB; the `db` of the service's config (SYSTEM_CONFIG); the per-user state path."""
    from ..config import default_db_path, load_config

    config = load_config(config_path)
    if db is not None:
        return config, db, None
    if config.db is not None:
        return config, config.db, f"the `db` of {config_path}"
    if os.environ.get("NANWATCH_DB"):
        return config, default_db_path(), "$NANWATCH_DB"
    if config_path is None and SYSTEM_CONFIG.exists():
        try:
            system = load_config(SYSTEM_CONFIG)
        except ConfigError as e:
            if not os.access(SYSTEM_CONFIG, os.R_OK):
                # a config only the service may read: say so, and read the per-user database
                click.echo(
                    f"nanwatch: note: cannot read {SYSTEM_CONFIG} (the service's config); "
                    "pass --db FILE to read the service's database",
                    err=True,
                )
                return config, default_db_path(), None
            raise e
        if system.db is not None:
            return system, system.db, f"the `db` of {SYSTEM_CONFIG}"
        return system, default_db_path(), None
    return config, default_db_path(), None


def open_reader(config_path: Path | None, db: Path | None, *, quiet: bool = False) -> Store:
    """Open the database for reading; name it on stderr (unless ``quiet``: --json) when it is
    not the one the user named or the per-user default."""
    from ..store import Store

    _, path, origin = find_db(config_path, db)
    if origin is not None and not quiet:
        click.echo(f"nanwatch: database {path} ({origin})", err=True)
    try:
        return Store.open(path, readonly=True)
    except StoreError as e:
        if db is None and origin is None and not path.exists():
            raise StoreError(
                f"{path}: no database here yet, and no service config at {SYSTEM_CONFIG} names "
                "one; run `nanwatch scan PATH` first, or pass --db FILE or --config FILE "
                "(the service's config)"
            ) from None
        raise e


def emit_json(value: object) -> None:
    click.echo(json.dumps(value, separators=(",", ":"), default=str, ensure_ascii=False))


def out_width() -> int | None:
    """How wide stdout's lines may be: $COLUMNS, else the terminal's, else (piped) no limit."""
    cols = os.environ.get("COLUMNS", "")
    if cols.strip().isdigit() and int(cols) > 0:
        return int(cols)
    stream = sys.stdout
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or None
    except (OSError, ValueError, AttributeError):
        pass
    return None


def out_color() -> bool:
    """Colour on a terminal, never when piped, never with $NO_COLOR (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    stream = sys.stdout
    try:
        return bool(stream.isatty())
    except (ValueError, AttributeError):
        return False
