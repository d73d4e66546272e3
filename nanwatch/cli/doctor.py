"""`nanwatch doctor`: is this node ready to run the service? Every problem comes with its fix."""

from __future__ import annotations

import errno
import glob
import json
import os
import socket
import sqlite3
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from ._common import EXIT_ERROR, config_option, db_option, emit_json, json_option

INOTIFY = Path("/proc/sys/fs/inotify")
WALK_BUDGET = 10.0  # seconds spent counting folders and files below the sources
SLACK_API = "https://slack.com/api/"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | warn | fail | skip
    message: str
    fix: str | None = None


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


def _as_root_note() -> str:
    if os.geteuid() != 0:
        return ""
    return (
        " (checked as root, who reads everything: `sudo -u nanwatch nanwatch doctor ...` "
        "checks what the service user can read)"
    )


# --- config -------------------------------------------------------------------------------------


def check_config(config_path: Path | None) -> tuple[Any, list[Finding]]:
    from ..config import Config, load_config
    from ..daemon import preflight
    from ..errors import NanwatchError
    from .ingest import _sinks

    out: list[Finding] = []
    if config_path is None:
        out.append(
            Finding(
                "config",
                "warn",
                "no config file given: checking the defaults",
                "pass --config /etc/nanwatch/nanwatch.toml (or set $NANWATCH_CONFIG)",
            )
        )
    try:
        config = load_config(config_path)
    except NanwatchError as e:
        return None, [*out, Finding("config", "fail", str(e), "edit the file as the message says")]
    try:
        plan = preflight(config, (), lambda c: _sinks(c, console=False))
    except NanwatchError as e:
        return config or Config(), [*out, Finding("config", "fail", str(e), _fix_of(str(e)))]
    if config_path is not None:
        out.append(
            Finding(
                "config",
                "ok",
                f"{config_path}: valid; {len(plan.paths)} source path(s), "
                f"{len(plan.rules.rules)} rule(s)",
            )
        )
        mode = os.stat(config_path).st_mode
        if mode & stat.S_IWOTH:
            out.append(
                Finding(
                    "permissions",
                    "fail",
                    f"{config_path}: anyone may write it (mode {stat.filemode(mode)})",
                    f"chmod 0644 {config_path}",
                )
            )
    return config, out


def _fix_of(message: str) -> str:
    if "nothing to watch" in message:
        return "list the training log folders in [sources] paths"
    return "edit the config as the message says"


# --- sources, inotify, filesystems ---------------------------------------------------------------


@dataclass
class _Tree:
    files: int = 0
    dirs: int = 0
    unreadable: list[str] | None = None
    truncated: bool = False


def _walk(base: str, recursive: bool, deadline: float) -> _Tree:
    tree = _Tree(unreadable=[])
    assert tree.unreadable is not None
    stack = [base]
    while stack:
        if time.monotonic() > deadline:
            tree.truncated = True
            break
        d = stack.pop()
        tree.dirs += 1
        try:
            entries = list(os.scandir(d))
        except PermissionError:
            tree.unreadable.append(d + "/")
            continue
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        stack.append(e.path)
                elif e.is_file():
                    tree.files += 1
                    if not os.access(e.path, os.R_OK):
                        tree.unreadable.append(e.path)
            except OSError:
                continue
    return tree


def check_sources(config: Any) -> tuple[list[Finding], int, int, list[Any]]:
    """Findings, folders to watch, inotify instances needed, roots."""
    from ..errors import SourceError
    from ..sources import make_roots

    out: list[Finding] = []
    try:
        roots = make_roots(list(config.sources.paths), must_exist=False)
    except SourceError as e:
        return [Finding("sources", "fail", str(e), "fix [sources] paths")], 0, 0, []
    dirs = 0
    deadline = time.monotonic() + WALK_BUDGET
    for root in roots:
        if root.kind == "glob" and not glob.glob(root.path, recursive=True):
            out.append(
                Finding(
                    "sources",
                    "warn",
                    f"{root.spec}: matches nothing yet (followed once something matches)",
                    "check the pattern in [sources] paths",
                )
            )
            continue
        base = root.base if root.kind != "file" else root.path
        if not os.path.exists(base):
            out.append(
                Finding(
                    "sources",
                    "warn",
                    f"{root.spec}: does not exist yet (followed once it appears)",
                    "create it, or fix [sources] paths",
                )
            )
            continue
        if root.kind == "file":
            ok = os.access(root.path, os.R_OK)
            dirs += 1
            out.append(
                Finding("sources", "ok", f"{root.spec}: a readable file")
                if ok
                else Finding(
                    "sources",
                    "fail",
                    f"{root.spec}: not readable by {_user()}",
                    f"setfacl -m u:nanwatch:r {root.path} (or add nanwatch to its group)",
                )
            )
            continue
        tree = _walk(root.base, True, deadline)
        dirs += tree.dirs
        more = " (stopped counting: the walk took too long)" if tree.truncated else ""
        if tree.unreadable:
            shown = ", ".join(tree.unreadable[:3])
            out.append(
                Finding(
                    "sources",
                    "fail",
                    f"{root.spec}: {len(tree.unreadable)} of {tree.files} file(s) or folders not "
                    f"readable by {_user()}, e.g. {shown}",
                    f"setfacl -R -m u:nanwatch:rX,d:u:nanwatch:rX {root.base} (or add the "
                    "service user to the owning group: SupplementaryGroups= in a drop-in)",
                )
            )
        else:
            out.append(
                Finding(
                    "sources",
                    "ok",
                    f"{root.spec}: {tree.files} file(s) in {tree.dirs} folder(s), all "
                    f"readable{more}{_as_root_note()}",
                )
            )
    instances = len({r.base for r in roots})
    return out, dirs, instances, roots


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def inotify_usage(uid: int) -> tuple[int, int] | None:
    """(watches, instances) held by the processes of ``uid`` that this user may inspect."""
    watches = instances = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
                    watches += sum(1 for line in f if line.startswith("inotify wd:"))
                instances += 1
            except OSError:
                continue
    return watches, instances


def inotify_verdict(
    need_watches: int,
    need_instances: int,
    max_watches: int | None,
    max_instances: int | None,
    used: tuple[int, int] | None,
) -> Finding:
    """Enough inotify watches and instances for the folders to follow, beside current use?"""
    if max_watches is None or max_instances is None:
        return Finding(
            "inotify",
            "warn",
            f"cannot read {INOTIFY}: limits unknown",
            "run doctor on the node itself",
        )
    uw, ui = used or (0, 0)
    in_use = f" ({uw} watches, {ui} instances already in use by the service user)" if used else ""
    short = []
    if need_watches + uw > max_watches:
        want = max(524288, 1 << (2 * (need_watches + uw)).bit_length())
        short.append(
            (
                f"fs.inotify.max_user_watches = {max_watches} is below the {need_watches} "
                "folder(s) to watch",
                f"fs.inotify.max_user_watches={want}",
            )
        )
    if need_instances + ui > max_instances:
        want = max(1024, 2 * (need_instances + ui))
        short.append(
            (
                f"fs.inotify.max_user_instances = {max_instances} is below the {need_instances} "
                "watch(es) to start",
                f"fs.inotify.max_user_instances={want}",
            )
        )
    if not short:
        return Finding(
            "inotify",
            "ok",
            f"{need_watches} folder(s) to watch, {need_instances} instance(s); limits "
            f"{max_watches} watches, {max_instances} instances{in_use}",
        )
    settings = " ".join(s for _, s in short)
    return Finding(
        "inotify",
        "warn",
        "; ".join(m for m, _ in short) + f"{in_use}: polling will be used where watches fail "
        "(slower to notice, more CPU)",
        f"sysctl -w {settings} and persist it: printf '%s\\n' {settings} > "
        "/etc/sysctl.d/90-nanwatch.conf",
    )


def check_inotify(need_watches: int, need_instances: int) -> Finding:
    uid = os.geteuid()
    try:
        import pwd

        uid = pwd.getpwnam("nanwatch").pw_uid
    except (ImportError, KeyError):
        pass
    return inotify_verdict(
        need_watches,
        need_instances,
        _read_int(INOTIFY / "max_user_watches"),
        _read_int(INOTIFY / "max_user_instances"),
        inotify_usage(uid),
    )


def check_filesystems(config: Any, roots: list[Any]) -> list[Finding]:
    from ..sources.watcher import NETWORK_FS, filesystem_type

    out = []
    mode = config.sources.mode
    for r in roots:
        base = r.base if os.path.exists(r.base) else os.path.dirname(r.base)
        fs = filesystem_type(base) or "unknown"
        remote = fs in NETWORK_FS
        if remote and mode == "inotify":
            out.append(
                Finding(
                    "filesystem",
                    "warn",
                    f"{r.spec}: on {fs}, but [sources] mode = 'inotify': writes made by other "
                    "hosts are never noticed until the next 30s check",
                    "set [sources] mode = 'auto' (polls network filesystems)",
                )
            )
        elif remote or mode == "poll":
            why = f"{fs} is a network filesystem" if remote else "[sources] mode = 'poll'"
            out.append(
                Finding(
                    "filesystem",
                    "ok",
                    f"{r.spec}: on {fs}; polled every {config.sources.poll_interval:g}s ({why})",
                )
            )
        else:
            out.append(Finding("filesystem", "ok", f"{r.spec}: on {fs}; inotify"))
    return out


# --- database -----------------------------------------------------------------------------------


def check_database(db: Path, config: Any) -> list[Finding]:
    from ..store.db import SCHEMA_VERSION

    if not db.exists():
        folder = next((p for p in [db.parent, *db.parent.parents] if p.exists()), Path("/"))
        if os.access(folder, os.W_OK | os.X_OK):
            return [Finding("database", "ok", f"{db}: not created yet; {folder} is writable")]
        return [
            Finding(
                "database",
                "fail",
                f"{db}: cannot be created: {folder} is not writable by {_user()}",
                "use the unit's StateDirectory (/var/lib/nanwatch) or chown the folder",
            )
        ]
    out = []
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
            vacuum = conn.execute("PRAGMA auto_vacuum").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as e:
        check, journal, vacuum, version, page, pages, free = str(e), "", 0, 0, 0, 0, 0
    if check != "ok":
        return [
            Finding(
                "database",
                "fail",
                f"{db}: damaged ({check})",
                f"stop nanwatch; mv {db} {db}.bad; then start afresh, or salvage it: "
                f"sqlite3 {db}.bad .recover | sqlite3 {db}",
            )
        ]
    size = db.stat().st_size + (
        Path(f"{db}-wal").stat().st_size if Path(f"{db}-wal").exists() else 0
    )
    used = (pages - free) * page
    out.append(
        Finding(
            "database",
            "ok",
            f"{db}: intact, schema {version}, {size / 1e6:.1f} MB on disk "
            f"({used / 1e6:.1f} MB live, {free * page / 1e6:.1f} MB free)",
        )
    )
    if version > SCHEMA_VERSION:
        out.append(
            Finding(
                "database",
                "fail",
                f"{db}: written by a newer nanwatch (schema {version} > {SCHEMA_VERSION})",
                "upgrade nanwatch",
            )
        )
    elif version < SCHEMA_VERSION:
        out.append(
            Finding("database", "ok", f"{db}: schema {version} is migrated at the next start")
        )
    if version and journal != "wal":
        out.append(
            Finding(
                "database",
                "warn",
                f"{db}: journal mode {journal!r}, not WAL: readers may block the daemon",
                "start nanwatch watch once: it switches the database to WAL",
            )
        )
    if version and vacuum != 2:
        out.append(
            Finding(
                "database",
                "warn",
                f"{db}: auto_vacuum is off: retention frees space inside the file, which never "
                "shrinks",
                f"stop nanwatch, then: sqlite3 {db} 'PRAGMA auto_vacuum=INCREMENTAL; VACUUM;'",
            )
        )
    cap = config.store.max_size if config is not None else None
    if cap and used > cap:
        out.append(
            Finding(
                "database",
                "warn",
                f"{db}: {used / 1e6:.0f} MB live, above [store] max_size ({cap / 1e6:.0f} MB)",
                "the running service trims it within minutes; else raise max_size",
            )
        )
    writable = os.access(db, os.W_OK) and os.access(db.parent, os.W_OK | os.X_OK)
    if not writable:
        out.append(
            Finding(
                "database",
                "fail",
                f"{db}: not writable by {_user()} (the file and its folder must be, for the WAL)",
                f"chown -R nanwatch:nanwatch {db.parent} (the service user)",
            )
        )
    return out


# --- slack, metrics -----------------------------------------------------------------------------


def _http(
    req: urllib.request.Request, timeout: float = 5.0, *, proxy: bool = True
) -> tuple[int, bytes]:
    """(status, body); Slack goes through $HTTPS_PROXY like the service, loopback never does."""
    opener = urllib.request.build_opener(*([] if proxy else [urllib.request.ProxyHandler({})]))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read(1 << 20)
    except urllib.error.HTTPError as e:
        return int(e.code), e.read(1 << 20)


def check_slack(config: Any) -> list[Finding]:
    from ..config import read_secret
    from ..errors import ConfigError

    sc = config.slack
    if not sc.enabled:
        return [Finding("slack", "skip", "no [slack] section: nothing to check")]
    base = (sc.base_url or SLACK_API).rstrip("/") + "/"
    out = []
    if sc.token_file and os.path.exists(sc.token_file):
        mode = os.stat(sc.token_file).st_mode
        if mode & stat.S_IROTH:
            out.append(
                Finding(
                    "permissions",
                    "fail",
                    f"[slack] token_file {sc.token_file}: readable by every user",
                    f"chmod 0640 {sc.token_file} (or pass it with LoadCredential=)",
                )
            )
    try:
        token = read_secret(
            file=sc.token_file,
            credential="slack-token",
            env="SLACK_BOT_TOKEN",
            key="[slack] token_file",
        )
        hook = sc.webhook_url or read_secret(
            file=sc.webhook_url_file,
            credential="slack-webhook",
            env=None,
            key="[slack] webhook_url_file",
        )
    except ConfigError as e:
        return [*out, Finding("slack", "fail", str(e), "fix the file as the message says")]
    if token:
        req = urllib.request.Request(
            base + "auth.test",
            data=b"",
            method="POST",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            code, body = _http(req)
            answer = json.loads(body or b"{}")
        except (OSError, ValueError) as e:
            return [*out, _unreachable(base, e)]
        if code == 200 and answer.get("ok"):
            who = f"{answer.get('user', '?')} in {answer.get('team', '?')}"
            return [
                *out,
                Finding("slack", "ok", f"{base}: the token works (authenticated as {who})"),
            ]
        err = answer.get("error") or f"HTTP {code}"
        return [
            *out,
            Finding(
                "slack",
                "fail",
                f"{base}auth.test refused the token: {err}",
                "put a valid bot token (xoxb-...) in /etc/nanwatch/slack-token (LoadCredential) "
                "or [slack] token_file, and restart nanwatch",
            ),
        ]
    if hook:
        host = urllib.parse.urlsplit(hook).netloc  # never the secret path
        try:
            # a GET posts nothing: any HTTP answer proves the way there
            code, _ = _http(urllib.request.Request(hook, method="GET"))
        except OSError as e:
            return [*out, _unreachable(host, e)]
        return [*out, Finding("slack", "ok", f"webhook host {host} reachable (HTTP {code})")]
    return [
        *out,
        Finding(
            "slack",
            "fail",
            "[slack] is configured but no bot token or webhook URL is available",
            "put the bot token in /etc/nanwatch/slack-token (the unit's LoadCredential=), "
            "or set [slack] token_file, or $SLACK_BOT_TOKEN",
        ),
    ]


def _unreachable(where: str, e: BaseException) -> Finding:
    reason = getattr(e, "reason", None) or e
    return Finding(
        "slack",
        "fail",
        f"cannot reach {where}: {reason}",
        "check the node's route to Slack (firewall, HTTPS_PROXY in a drop-in: "
        "Environment=HTTPS_PROXY=...), or [slack] base_url",
    )


def check_metrics(config: Any) -> Finding:
    from ..errors import ConfigError
    from ..metrics import parse_listen

    listen = config.metrics.listen
    if listen is None:
        return Finding("metrics", "skip", "no [metrics] listen: no metrics endpoint")
    try:
        host, port = parse_listen(listen)
    except ConfigError as e:
        return Finding("metrics", "fail", str(e), "fix [metrics] listen")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return Finding("metrics", "ok", f"{listen}: free; the service will serve /metrics")
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return Finding(
                    "metrics",
                    "fail",
                    f"{listen}: cannot listen ({e.strerror})",
                    "pick an address of this host in [metrics] listen",
                )
    url = f"http://{'[' + host + ']' if ':' in host else host or '127.0.0.1'}:{port}/metrics"
    try:
        code, body = _http(urllib.request.Request(url), timeout=3, proxy=False)
    except OSError:
        code, body = 0, b""
    if code == 200 and b"nanwatch_info" in body:
        return Finding("metrics", "ok", f"{listen}: nanwatch is serving metrics there")
    return Finding(
        "metrics",
        "fail",
        f"{listen}: in use by another program",
        "pick a free port in [metrics] listen",
    )


# --- the command ---------------------------------------------------------------------------------


def run_checks(config_path: Path | None, db: Path | None) -> Iterator[Finding]:
    config, found = check_config(config_path)
    yield from found
    if config is None:
        return
    src, dirs, instances, roots = check_sources(config)
    yield from src
    if roots:
        yield check_inotify(dirs, instances)
        yield from check_filesystems(config, roots)
    yield from check_database(db if db is not None else config.db_path(), config)
    yield from check_slack(config)
    yield check_metrics(config)


@click.command()
@config_option
@db_option
@json_option
def doctor(config_path: Path | None, db: Path | None, as_json: bool) -> None:
    """Check that this node can run the nanwatch service, and say how to fix what is wrong.

    Checks the config (and everything `watch` would refuse at start), the source paths
    (exist, readable), inotify limits against the folders to watch (polling is used where
    they run out), filesystem types (network filesystems are polled), the database (integrity,
    WAL, size, schema version, writable), Slack (auth.test with the token, when [slack] is
    configured) and the metrics address. Exit status 0 when nothing failed (warnings allowed),
    1 otherwise.

    \b
    Examples:
      nanwatch doctor --config /etc/nanwatch/nanwatch.toml
      sudo -u nanwatch nanwatch doctor --config /etc/nanwatch/nanwatch.toml
      nanwatch doctor --json | jq 'select(.status != "ok")'
    """
    findings = []
    if not as_json:
        where = config_path or "no config"
        click.echo(f"nanwatch doctor: {where}, as user {_user()}")
    for f in run_checks(config_path, db):
        findings.append(f)
        if as_json:
            emit_json(asdict(f))
            continue
        click.echo(f"  {f.status:<5} {f.check:<11} {f.message}")
        if f.fix and f.status in ("warn", "fail"):
            click.echo(f"  {'':<5} {'':<11} fix: {f.fix}")
    failed = sum(f.status == "fail" for f in findings)
    warned = sum(f.status == "warn" for f in findings)
    if not as_json:
        verdict = "ready" if not failed else "not ready"
        click.echo(f"{verdict}: {failed} problem(s), {warned} warning(s)")
    if failed:
        raise SystemExit(EXIT_ERROR)
