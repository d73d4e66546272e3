"""`nanwatch doctor`, what the service writes and talks to: database, Slack, metrics address."""

from __future__ import annotations

import errno
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .doctor import Finding, current_user

if TYPE_CHECKING:
    from ..config import Config

SLACK_API = "https://slack.com/api/"


def check_database(db: Path, config: Config | None) -> list[Finding]:
    from ..store.db import SCHEMA_VERSION, recovery_steps
    from ..store.reads import file_health

    if not db.exists():
        folder = next((p for p in [db.parent, *db.parent.parents] if p.exists()), Path("/"))
        if os.access(folder, os.W_OK | os.X_OK):
            return [Finding("database", "ok", f"{db}: not created yet; {folder} is writable")]
        return [
            Finding(
                "database",
                "fail",
                f"{db}: cannot be created: {folder} is not writable by {current_user()}",
                "use the unit's StateDirectory (/var/lib/nanwatch) or chown the folder",
            )
        ]
    out = []
    h = file_health(db)
    check, journal, vacuum, version = h.check, h.journal, h.auto_vacuum, h.version
    page, pages, free = h.page_size, h.pages, h.free
    if check != "ok":
        return [
            Finding(
                "database",
                "fail",
                f"{db}: damaged ({check})",
                recovery_steps(db),
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
                f"{db}: not writable by {current_user()} (the file and its folder must be: WAL)",
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


def check_slack(config: Config) -> list[Finding]:
    from ..errors import ConfigError
    from ..notify.slack_api import slack_settings

    sc = config.slack
    if not sc.enabled:
        return [Finding("slack", "skip", "no [slack] section: nothing to check")]
    base = (sc.base_url or SLACK_API).rstrip("/") + "/"
    out: list[Finding] = []
    try:
        # the very code `watch` runs, so doctor and the daemon never disagree about a secret
        settings = slack_settings(config)
    except ConfigError as e:
        if "no bot token" in str(e):
            return [
                Finding(
                    "slack",
                    "fail",
                    "[slack] is configured but no bot token or webhook URL is available",
                    "put the bot token in /etc/nanwatch/slack-token (the unit's LoadCredential=), "
                    "or set [slack] token_file, or $SLACK_BOT_TOKEN",
                )
            ]
        check = "permissions" if "chmod" in str(e) or "cannot read" in str(e) else "slack"
        return [Finding(check, "fail", str(e), "fix the file as the message says")]
    assert settings is not None
    token, hook = settings.token, settings.webhook_url
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


def check_metrics(config: Config) -> Finding:
    from ..config import parse_listen
    from ..errors import ConfigError

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
