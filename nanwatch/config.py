"""Configuration: one TOML file, every key optional, unknown keys are errors.

A bad file fails at start with a :class:`~nanwatch.errors.ConfigError` that names the file,
the key and the fix (for a misspelt key: the nearest valid one).
"""

from __future__ import annotations

import math
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ._dc import dataclass
from .errors import ConfigError

# patterns compile on first use (``re``'s own cache): most commands parse no duration or size
_DURATION_PART = r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)"
_DURATION = r"^(?:\d+(?:\.\d+)?(?:ms|s|m|h|d|w|y))+$"
_UNIT = {
    "ms": 0.001,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "y": 365 * 86400.0,
}
_DURATION_EXAMPLES = "30s, 5m, 1m30s, 4h or 90d"


def parse_duration(value: object, *, where: str = "duration") -> float:
    """Seconds from ``30``, ``30s``, ``5m``, ``4h``, ``90d`` or a compound such as ``1m30s``
    or ``1h30m`` (Alertmanager's spelling). NaN, infinity and negative values are refused."""
    if isinstance(value, bool):
        raise ConfigError(
            f"{where}: expected a duration such as {_DURATION_EXAMPLES}, got {value!r}"
        )
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ConfigError(
                f"{where} = {value!r}: not a duration; write a finite one such as "
                f"{_DURATION_EXAMPLES}"
            )
        if value < 0:
            raise ConfigError(f"{where}: a duration cannot be negative ({value})")
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            return float(text)
        if re.match(_DURATION, text):
            return sum(float(n) * _UNIT[u] for n, u in re.findall(_DURATION_PART, text))
    raise ConfigError(f"{where}: expected a duration such as {_DURATION_EXAMPLES}, got {value!r}")


def format_duration(seconds: float) -> str:
    """``90`` -> ``1m30s``; the inverse of :func:`parse_duration`, for messages."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms" if seconds else "0s"
    out = []
    rest = seconds
    for unit in ("d", "h", "m"):
        n = int(rest // _UNIT[unit])
        if n:
            out.append(f"{n}{unit}")
            rest -= n * _UNIT[unit]
    if rest or not out:
        out.append(f"{rest:g}s")
    return "".join(out)


_SIZE = r"(?i)^\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?b?|b)?\s*$"
_SIZE_UNIT = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


def parse_size(value: object, *, where: str = "size") -> int:
    """Bytes from ``1048576``, ``500MB``, ``4GB``, ``2GiB``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str):
        m = re.match(_SIZE, value)
        if m:
            unit = (m.group(2) or "").lower()
            factor = _SIZE_UNIT[unit[:1]]
            if "i" in unit:
                factor = 1 << {"k": 10, "m": 20, "g": 30, "t": 40, "p": 50}[unit[0]]
            size = int(float(m.group(1)) * factor)
            if size > 0:
                return size
    raise ConfigError(f"{where}: expected a size such as 500MB or 4GB, got {value!r}")


def _format_size(n: int) -> str:
    for unit, factor in (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6)):
        if n >= factor:
            return f"{n / factor:g}{unit}"
    return f"{n}B"


def parse_listen(value: str, *, where: str = "[metrics] listen") -> tuple[str, int]:
    """``host:port`` (``[::1]:9464`` for IPv6, ``:9464`` for every interface)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"{where} = {value!r}: expected host:port such as 127.0.0.1:9464 or [::1]:9464"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def default_db_path() -> Path:
    """``$NANWATCH_DB``, else the per-user state directory."""
    env = os.environ.get("NANWATCH_DB")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "nanwatch" / "nanwatch.db"


@dataclass(frozen=True)
class SourcesConfig:
    """[sources]: what `watch` follows without PATH, and how it learns that files changed."""

    paths: tuple[str, ...] = ()
    mode: str = "auto"  # auto | inotify | poll
    poll_interval: float = 2.0


@dataclass(frozen=True)
class DetectConfig:
    """[detect]: site rule packs, read before the shipped ones."""

    rule_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class KnowledgeConfig:
    """[knowledge]: site known causes, and versions and timeouts that override the logs'."""

    dirs: tuple[str, ...] = ()
    cann_version: str | None = None
    hccl_exec_timeout: float | None = None
    nccl_timeout: float | None = None


@dataclass(frozen=True)
class ShapesConfig:
    """[shapes]: the checkpoint msprobe findings are looked up in (else the run's newest)."""

    checkpoint: str | None = None


@dataclass(frozen=True)
class StoreConfig:
    """[store]: retention: how long rows are kept, how big the live data may grow."""

    keep: float | None = None  # seconds; None keeps everything
    max_size: int | None = None  # bytes of live data; the oldest rows go first beyond it


@dataclass(frozen=True)
class AlertsConfig:
    """[alerts]: when incidents are notified, repeated and resolved (seconds)."""

    group_wait: float = 30.0
    group_interval: float = 300.0
    repeat_interval: float = 4 * 3600.0
    resolve_after: float = 3600.0


@dataclass(frozen=True)
class SlackConfig:
    """[slack]: where notifications go in Slack (bot token or webhook), and routes."""

    enabled: bool = False
    channel: str | None = None
    token_file: str | None = None
    base_url: str | None = None
    webhook_url: str | None = None
    webhook_url_file: str | None = None
    routes: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class AlertmanagerConfig:
    """[alertmanager]: the Alertmanager instances incidents are posted to."""

    urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: the Prometheus endpoint's address."""

    listen: str | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """[cluster]: the job, run and node names this node's runs take."""

    job: str | None = None
    run: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class FleetConfig:
    """Fleet mode: this node forwards to (or ``nanwatch fleet`` correlates) a PostgreSQL store."""

    dsn: str | None = None  # postgresql://user@host:port/db, never with its password
    password_file: str | None = None
    heartbeat: float = 60.0  # a node forwards at least this often; silent for 3x: a suspect
    hold: float = 120.0  # a symptom incident waits this long for its root before it is sent
    state_db: str | None = None  # the correlator's working database (default: beside db)
    notify_locally: bool = False  # nodes in fleet mode leave notifications to the correlator


@dataclass(frozen=True)
class Config:
    """The whole configuration file: every section, with its defaults when absent."""

    path: Path | None = None
    db: Path | None = None
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    knowledge: KnowledgeConfig = field(default_factory=KnowledgeConfig)
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    slack: SlackConfig = field(default_factory=SlackConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)

    def db_path(self) -> Path:
        return self.db if self.db is not None else default_db_path()


# --- schema -------------------------------------------------------------------------------------

_Conv = Callable[[object, str, Path | None], object]


def _str(v: object, where: str, base: Path | None) -> object:
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {type(v).__name__} {v!r}")
    return v


def _path(v: object, where: str, base: Path | None) -> object:
    s = _str(v, where, base)
    assert isinstance(s, str)
    p = Path(os.path.expanduser(s))
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p)


def _paths(v: object, where: str, base: Path | None) -> object:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list of paths, got {type(v).__name__}")
    return tuple(_path(x, f"{where}[{i}]", base) for i, x in enumerate(v))


def _urls(v: object, where: str, base: Path | None) -> object:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}: expected a URL or a list of URLs")
    for x in v:
        parsed = urlparse(x)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(
                f"{where}: {x!r} is not an http(s) URL; expected e.g. http://alertmanager:9093"
            )
    return tuple(v)


def _duration_in(lo: float, hi: float, example: str) -> _Conv:
    """A duration converter that refuses values outside [lo, hi] (NaN and infinity too): a
    poll interval of 1e-9 s spins a core, one of 1e9 s never looks again."""

    def conv(v: object, where: str, base: Path | None) -> object:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            d = float(v)  # NaN fails the comparison below: every bad number gets the range
        else:
            d = parse_duration(v, where=where)
        if not lo <= d <= hi:
            raise ConfigError(
                f"{where} = {v!r}: out of range; expected a duration from {format_duration(lo)} "
                f"to {format_duration(hi)}, such as {example}"
            )
        return d

    return conv


def _size_in(lo: int, hi: int, example: str) -> _Conv:
    def conv(v: object, where: str, base: Path | None) -> object:
        n = parse_size(v, where=where)
        if not lo <= n <= hi:
            raise ConfigError(
                f"{where} = {v!r}: out of range; expected a size from {_format_size(lo)} "
                f"to {_format_size(hi)}, such as {example}"
            )
        return n

    return conv


_DAY = 86400.0
# Wide enough for tests and small sites, narrow enough that no value can spin, overflow or
# never fire. One table, so the README and the messages agree.
RANGES: dict[tuple[str, str], tuple[float, float, str]] = {
    ("sources", "poll_interval"): (0.1, 3600.0, "2s"),
    ("knowledge", "hccl_exec_timeout"): (1.0, 7 * _DAY, "30m"),
    ("knowledge", "nccl_timeout"): (1.0, 7 * _DAY, "10m"),
    ("store", "keep"): (3600.0, 3650 * _DAY, "90d"),
    ("alerts", "group_wait"): (0.0, 3600.0, "30s"),
    ("alerts", "group_interval"): (1.0, _DAY, "5m"),
    ("alerts", "repeat_interval"): (60.0, 30 * _DAY, "4h"),
    ("alerts", "resolve_after"): (1.0, 30 * _DAY, "1h"),
    ("fleet", "heartbeat"): (1.0, _DAY, "60s"),
    ("fleet", "hold"): (0.0, _DAY, "2m"),
}
SIZE_RANGES: dict[tuple[str, str], tuple[int, int, str]] = {
    ("store", "max_size"): (1 << 20, 10**15, "4GB"),
}


def _ranged(section: str, key: str) -> _Conv:
    if (section, key) in SIZE_RANGES:
        return _size_in(*SIZE_RANGES[section, key])
    lo, hi, example = RANGES[section, key]
    return _duration_in(lo, hi, example)


def _listen(v: object, where: str, base: Path | None) -> object:
    s = _str(v, where, base)
    assert isinstance(s, str)
    parse_listen(s, where=where)
    return s


def _mode(v: object, where: str, base: Path | None) -> object:
    if v not in ("auto", "inotify", "poll"):
        raise ConfigError(f"{where}: expected one of auto, inotify, poll; got {v!r}")
    return v


def _url(v: object, where: str, base: Path | None) -> object:
    s = _str(v, where, base)
    assert isinstance(s, str)
    parsed = urlparse(s)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{where}: expected an http(s) URL such as https://slack.com/api/")
    return s


def _dsn(v: object, where: str, base: Path | None) -> object:
    s = _str(v, where, base)
    assert isinstance(s, str)
    parsed = urlparse(s)
    if parsed.scheme not in ("postgresql", "postgres") or not parsed.hostname:
        raise ConfigError(
            f"{where}: expected a PostgreSQL URL such as "
            '"postgresql://nanwatch@fleet-db:5432/nanwatch"'
        )
    if parsed.password is not None:
        raise ConfigError(
            f"{where}: the URL holds a password; remove it and put the password in "
            "password_file (mode 600), the unit's LoadCredential=fleet-password, or PGPASSWORD"
        )
    return s


def _bool(v: object, where: str, base: Path | None) -> object:
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: expected true or false; got {v!r}")
    return v


def _routes(v: object, where: str, base: Path | None) -> object:
    from .events import KINDS

    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ConfigError(
            f"{where}: expected a list of tables such as "
            '[{ kinds = ["oom"], channel = "#oncall" }]'
        )
    out = []
    for i, r in enumerate(v):
        unknown = set(r) - {"kinds", "severities", "channel", "runs"}
        if unknown:
            raise ConfigError(
                f"{where}[{i}]: unknown key {sorted(unknown)[0]!r}; "
                "valid keys: kinds, severities, runs, channel"
            )
        if not isinstance(r.get("channel"), str) or not r["channel"]:
            raise ConfigError(f'{where}[{i}]: a route needs a channel, e.g. channel = "#oncall"')
        route: dict[str, Any] = {"channel": r["channel"]}
        for key in ("kinds", "severities", "runs"):
            value = r.get(key)
            if value is None:
                continue
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise ConfigError(f"{where}[{i}] {key}: expected a list of strings")
            if key == "kinds":
                bad = [k for k in value if k not in KINDS]
                if bad:
                    raise ConfigError(
                        f"{where}[{i}] kinds: unknown kind {bad[0]!r}; "
                        f"valid kinds: {', '.join(sorted(KINDS))}"
                    )
            route[key] = tuple(value)
        out.append(route)
    return tuple(out)


def _check_slack(slack: Mapping[str, object], where: str) -> None:
    """Combinations of [slack] keys that cannot work (the secrets are read when sending)."""
    hook = [k for k in ("webhook_url", "webhook_url_file") if slack.get(k)]
    if len(hook) == 2:
        raise ConfigError(
            f"{where}: webhook_url and webhook_url_file are both set; keep one "
            "(webhook_url_file keeps the URL, a secret, out of the config)"
        )
    if hook and slack.get("token_file"):
        raise ConfigError(
            f"{where}: token_file and {hook[0]} are both set; a bot token (chat.postMessage, "
            "messages updated in place) or an incoming webhook: keep one"
        )
    if hook and slack.get("routes"):
        raise ConfigError(
            f"{where} routes: an incoming webhook posts to one channel only; "
            "use a bot token (token_file) to route incidents to several channels"
        )
    if not hook and not slack.get("channel"):
        raise ConfigError(
            f'{where}: channel is missing; set channel = "#training-alerts" (a name or an ID '
            "such as C0123456789) for the bot to post in"
        )


_SCHEMA: dict[str, dict[str, _Conv]] = {
    "": {"db": _path},
    "sources": {
        "paths": _paths,
        "mode": _mode,
        "poll_interval": _ranged("sources", "poll_interval"),
    },
    "detect": {"rule_dirs": _paths},
    "knowledge": {
        "dirs": _paths,
        "cann_version": _str,
        "hccl_exec_timeout": _ranged("knowledge", "hccl_exec_timeout"),
        "nccl_timeout": _ranged("knowledge", "nccl_timeout"),
    },
    "shapes": {"checkpoint": _path},
    "store": {"keep": _ranged("store", "keep"), "max_size": _ranged("store", "max_size")},
    "alerts": {
        "group_wait": _ranged("alerts", "group_wait"),
        "group_interval": _ranged("alerts", "group_interval"),
        "repeat_interval": _ranged("alerts", "repeat_interval"),
        "resolve_after": _ranged("alerts", "resolve_after"),
    },
    "slack": {
        "channel": _str,
        "token_file": _path,
        "base_url": _url,
        "webhook_url": _url,
        "webhook_url_file": _path,
        "routes": _routes,
    },
    "alertmanager": {"url": _urls, "urls": _urls},
    "metrics": {"listen": _listen},
    "cluster": {"job": _str, "run": _str, "node": _str},
    "fleet": {
        "dsn": _dsn,
        "password_file": _path,
        "heartbeat": _ranged("fleet", "heartbeat"),
        "hold": _ranged("fleet", "hold"),
        "state_db": _path,
        "notify_locally": _bool,
    },
}


def _nearest(name: str, options: list[str]) -> str:
    import difflib  # only to name a misspelt key

    near = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if near:
        return f"did you mean {near[0]!r}?"
    return "valid keys: " + ", ".join(sorted(o for o in options if o)) if options else ""


def parse_config(data: Mapping[str, Any], *, path: Path | None = None) -> Config:
    """Validate a parsed TOML document; raise ConfigError naming file, key and fix."""
    where_file = str(path) if path else "<config>"
    base = path.parent if path else None
    sections: dict[str, dict[str, object]] = {name: {} for name in _SCHEMA}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in _SCHEMA or key == "":
                raise ConfigError(
                    f"{where_file}: unknown section [{key}]; "
                    f"{_nearest(key, [s for s in _SCHEMA if s])}"
                )
            for sub, subval in value.items():
                if sub not in _SCHEMA[key]:
                    raise ConfigError(
                        f"{where_file}: unknown key {sub!r} in [{key}]; "
                        f"{_nearest(sub, list(_SCHEMA[key]))}"
                    )
                conv = _SCHEMA[key][sub]
                sections[key][sub] = conv(subval, f"{where_file}: [{key}] {sub}", base)
        else:
            if key not in _SCHEMA[""]:
                hint = _nearest(key, list(_SCHEMA[""]) + [s for s in _SCHEMA if s])
                raise ConfigError(f"{where_file}: unknown top-level key {key!r}; {hint}")
            sections[""][key] = _SCHEMA[""][key](value, f"{where_file}: {key}", base)

    s = sections
    if "slack" in data:
        _check_slack(s["slack"], f"{where_file}: [slack]")
    am = s["alertmanager"]
    am_urls: tuple[str, ...] = ()
    for key in ("urls", "url"):
        value = am.get(key, ())
        assert isinstance(value, tuple)
        am_urls += value
    db = s[""].get("db")
    return Config(
        path=path,
        db=Path(str(db)) if db else None,
        sources=SourcesConfig(**s["sources"]),  # type: ignore[arg-type]
        detect=DetectConfig(**s["detect"]),  # type: ignore[arg-type]
        knowledge=KnowledgeConfig(**s["knowledge"]),  # type: ignore[arg-type]
        shapes=ShapesConfig(**s["shapes"]),  # type: ignore[arg-type]
        store=StoreConfig(**s["store"]),  # type: ignore[arg-type]
        alerts=AlertsConfig(**s["alerts"]),  # type: ignore[arg-type]
        slack=SlackConfig(enabled="slack" in data, **s["slack"]),  # type: ignore[arg-type]
        alertmanager=AlertmanagerConfig(urls=am_urls),
        metrics=MetricsConfig(**s["metrics"]),  # type: ignore[arg-type]
        cluster=ClusterConfig(**s["cluster"]),  # type: ignore[arg-type]
        fleet=FleetConfig(**s["fleet"]),  # type: ignore[arg-type]
    )


def _toml() -> Any:
    """The TOML parser, imported when a file is read (a command without --config reads none)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 images
        import tomli as tomllib
    return tomllib


def __getattr__(name: str) -> Any:
    if name == "tomllib":  # the parser config files are read with, for the tests of examples
        return _toml()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Load and validate a config file; ``None`` gives the defaults."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: config file not found; pass an existing file to --config"
        ) from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the config file ({e.strerror})") from None
    tomllib = _toml()
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: the config file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    return parse_config(data, path=p.resolve())


# --- secrets ------------------------------------------------------------------------------------

# Credential names the unit passes with LoadCredential= (systemd/nanwatch.service).
SLACK_TOKEN_CREDENTIAL = "slack-token"
SLACK_WEBHOOK_CREDENTIAL = "slack-webhook"
FLEET_PASSWORD_CREDENTIAL = "fleet-password"


def read_secret_file(path: str, *, key: str, what: str = "secret", where: str = "") -> str:
    """A secret from a file that only its owner may read; ConfigError naming key and fix.

    One rule everywhere (``watch``, ``doctor``, the docs): owner-only, mode 0600, owned by the
    user nanwatch runs as. Not 0640 with group nanwatch: operators join that group to read the
    database, and they need not be able to post as the bot.
    """
    at = f"{where} {key}".strip()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{at} = {path!r}: no such file; write the {what} there "
            f"(one line, then chmod 600 {path}) or fix {key}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{at} = {path!r}: cannot stat it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{at} = {path!r}: not a regular file; point {key} at the file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{at} = {path!r}: the {what} file is open to group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); it is a secret: chmod 600 {path} "
            "(owned by the user nanwatch runs as), or pass it with LoadCredential="
        )
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except PermissionError:
        raise ConfigError(
            f"{at} = {path!r}: this user (uid {os.getuid()}) cannot read the {what} "
            f"file; chown it to the user nanwatch runs as (mode 600)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{at} = {path!r}: cannot read the {what} ({e})") from None
    if not value:
        raise ConfigError(f"{at} = {path!r}: the file is empty; write the {what} into it")
    if any(c.isspace() for c in value):
        raise ConfigError(
            f"{at} = {path!r}: the file holds more than one word; it must hold only the {what}"
        )
    return value


def read_secret(*, file: str | None, credential: str, env: str | None, key: str) -> str | None:
    """A secret (a token, a webhook URL) from the first place that has one, or None.

    1. ``file`` (the config's ``*_file`` key, named ``key`` in errors), read by
       :func:`read_secret_file` (owner-only);
    2. ``$CREDENTIALS_DIRECTORY/<credential>``: what systemd's ``LoadCredential=`` passes to
       the service (the unit's empty ``SetCredential=`` default counts as absent);
    3. the environment variable ``env``.

    Surrounding whitespace is stripped. The value itself never appears in an error.
    """
    if file:
        return read_secret_file(file, key=key)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds:
        try:
            value = (Path(creds) / credential).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            value = ""
        if value:
            return value
    if env:
        value = os.environ.get(env, "").strip()
        if value:
            return value
    return None
