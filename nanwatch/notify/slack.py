"""The Slack sink: one living message per incident.

Bot mode (a token, ``chat.postMessage``/``chat.update``): the first notification of an incident
posts its *parent* message; later ones edit it (counts, ranks, status) and add a thread reply
only when there is news (new ranks, the origin moved, resolved, a reminder). Channel and ``ts``
are kept in the ``messages`` table, so a restarted daemon edits the same message. Webhook mode
(an incoming-webhook URL, no ``ts``): one post per incident, follow-ups only with news and at
most one per ``group_interval``.

Delivery policy lives in the outbox (retries, backoff, silences); this module adds what is
Slack's own: a budget of about one call per second per channel, HTTP 429's ``Retry-After``
(the channel is left alone that long), and ``ok:false`` errors sorted into "retry",
"a person must fix something (retry slowly)" and "this message can never be sent".
slack_sdk's own retry handlers are off on purpose: a handler would sleep inside the sender and
forget its wait on restart, while the outbox keeps it in SQLite.
"""

from __future__ import annotations

import fnmatch
import http.client
import logging
import os
import re
import sqlite3
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from ..config import AlertsConfig, Config
from ..errors import ConfigError, DeliveryError
from ..events import parse_utc
from ..query import incident_dict
from .outbox import Deferred
from .slack_text import follow_up, headline, merged_news, parent_blocks

log = logging.getLogger("nanwatch.notify.slack")

DEFAULT_BASE_URL = "https://slack.com/api/"
TOKEN_ENV = "SLACK_BOT_TOKEN"
FIX_RETRY = 300.0  # seconds between tries while a person has to fix the app or channel
PACE = 1.0  # seconds between calls to one channel (Slack: about one message per second)

# ok:false errors: the request may work later on its own / after a person fixes something
_RETRYABLE = {
    "ratelimited",
    "internal_error",
    "fatal_error",
    "service_unavailable",
    "request_timeout",
    "team_added_to_org",
}
_NEEDS_FIX = {
    "not_authed": "the bot token was refused",
    "invalid_auth": "the bot token was refused",
    "account_inactive": "the bot token was refused",
    "token_revoked": "the bot token was revoked",
    "token_expired": "the bot token expired",
    "no_permission": "the app lacks a permission",
    "missing_scope": "the app lacks a scope (chat:write; files:write for plots)",
    "channel_not_found": "the channel does not exist or the app cannot see it",
    "not_in_channel": "the app is not a member of the channel",
    "is_archived": "the channel is archived",
    "restricted_action": "the workspace forbids the app to post there",
    "team_access_not_granted": "the app is not installed in that workspace",
    "ekm_access_denied": "the workspace's key management refused the message",
}
_BAD_MESSAGE = {"invalid_blocks", "invalid_blocks_format", "msg_too_long", "too_many_blocks"}
_WEBHOOK_FIX = {403: "action_prohibited", 404: "no_service", 410: "channel_is_archived"}


# slack_sdk logs a webhook's URL (a secret) at DEBUG; this logger never passes DEBUG on
_QUIET = logging.getLogger("nanwatch.notify.slack.webhook")
_QUIET.setLevel(logging.INFO)

# --- settings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlackSettings:
    """What the sink needs, resolved from ``[slack]``; secrets never appear in repr."""

    channel: str | None = None
    base_url: str = DEFAULT_BASE_URL
    routes: tuple[Mapping[str, Any], ...] = ()
    token: str | None = field(default=None, repr=False)
    webhook_url: str | None = field(default=None, repr=False)
    secret_source: str = ""  # where the secret came from, for messages

    @property
    def mode(self) -> str:
        return "webhook" if self.webhook_url else "bot"


def _where(config: Config) -> str:
    return f"{config.path or '<config>'}: [slack]"


def read_secret(path: str, *, key: str, what: str, where: str) -> str:
    """A secret from a file that only its owner may read; ConfigError naming key and fix."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(
            f"{where} {key} = {path!r}: no such file; write the {what} there "
            f"(one line, then chmod 600 {path}) or fix {key}"
        ) from None
    except OSError as e:
        raise ConfigError(f"{where} {key} = {path!r}: cannot stat it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{where} {key} = {path!r}: not a regular file; point {key} at the file")
    if st.st_mode & 0o066:
        raise ConfigError(
            f"{where} {key} = {path!r}: the {what} file is readable or writable by group or "
            f"others (mode {stat.S_IMODE(st.st_mode):04o}); it is a secret: chmod 600 {path}"
        )
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except PermissionError:
        raise ConfigError(
            f"{where} {key} = {path!r}: this user (uid {os.getuid()}) cannot read the {what} "
            f"file; chown it to the user nanwatch runs as (mode 600)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} {key} = {path!r}: cannot read the {what} ({e})") from None
    if not value:
        raise ConfigError(f"{where} {key} = {path!r}: the file is empty; write the {what} into it")
    if any(c.isspace() for c in value):
        raise ConfigError(
            f"{where} {key} = {path!r}: the file holds more than one word; it must hold only "
            f"the {what}"
        )
    return value


def slack_settings(config: Config) -> SlackSettings | None:
    """``[slack]`` with its secret read; None without the section; ConfigError if unusable."""
    sc = config.slack
    if not sc.enabled:
        return None
    where = _where(config)
    base_url = sc.base_url or DEFAULT_BASE_URL
    if not base_url.endswith("/"):
        base_url += "/"
    if sc.webhook_url_file or sc.webhook_url:
        if sc.webhook_url_file:
            url = read_secret(
                sc.webhook_url_file, key="webhook_url_file", what="webhook URL", where=where
            )
            source = f"webhook_url_file {sc.webhook_url_file}"
        else:
            url, source = str(sc.webhook_url), "webhook_url"
        if urlparse(url).scheme not in ("http", "https") or not urlparse(url).netloc:
            raise ConfigError(
                f"{where} {source}: not an http(s) URL; use the incoming webhook's URL "
                "(https://hooks.slack.com/services/...)"
            )
        return SlackSettings(
            channel=sc.channel, base_url=base_url, webhook_url=url, secret_source=source
        )
    if sc.token_file:
        token = read_secret(sc.token_file, key="token_file", what="bot token", where=where)
        source = f"token_file {sc.token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        source = f"${TOKEN_ENV}"
        if not token:
            raise ConfigError(
                f'{where}: no bot token: set token_file = "/etc/nanwatch/slack-token" (a file '
                f"of mode 600 holding the xoxb- token) or the environment variable {TOKEN_ENV}; "
                "or use webhook_url_file for an incoming webhook"
            )
    if not token.startswith("xox"):
        log.warning(
            "%s: the token from %s does not look like a Slack token (xoxb-...)", where, source
        )
    return SlackSettings(
        channel=sc.channel, base_url=base_url, routes=sc.routes, token=token, secret_source=source
    )


# --- errors -------------------------------------------------------------------------------------


def _header(headers: Any, name: str) -> str | None:
    for k, v in dict(headers or {}).items():
        if str(k).lower() == name:
            return str(v[0] if isinstance(v, list) else v)
    return None


def retry_after(headers: Any, default: float = 1.0) -> float:
    value = _header(headers, "retry-after")
    try:
        return max(float(value), 0.0) if value is not None else default
    except ValueError:
        return default


def api_error(e: Exception, method: str, channel: str | None = None) -> DeliveryError:
    """A SlackApiError as a DeliveryError: retryable, slow (needs a fix) or permanent."""
    resp = getattr(e, "response", None)
    status = int(getattr(resp, "status_code", 0) or 0)
    data = getattr(resp, "data", None)
    error = str(data.get("error") or "") if isinstance(data, dict) else ""
    if status == 429 or error == "ratelimited":
        wait = retry_after(getattr(resp, "headers", None))
        return DeliveryError(
            f"{method}: rate limited (HTTP 429), Retry-After {wait:g}s", retry_after=wait
        )
    if status >= 500 or error in _RETRYABLE or (status != 200 and not error):
        return DeliveryError(f"{method}: Slack answered HTTP {status} {error}".rstrip())
    if error in _NEEDS_FIX:
        fix = _fix(error, channel)
        return DeliveryError(
            f"{method}: {error}: {_NEEDS_FIX[error]}; {fix}", retry_after=FIX_RETRY
        )
    return DeliveryError(f"{method}: Slack refused the request: {error or status}", permanent=True)


def _fix(error: str, channel: str | None) -> str:
    if error in ("channel_not_found", "not_in_channel", "is_archived", "restricted_action"):
        return f"invite the app to {channel or 'the channel'} (/invite @app) or fix [slack] channel"
    if error in ("missing_scope", "no_permission"):
        return "add the scopes chat:write (and files:write) to the app and reinstall it"
    return f"put a valid xoxb- token in [slack] token_file (or ${TOKEN_ENV}) and restart"


# --- the sink -----------------------------------------------------------------------------------

_CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{6,}$")


class SlackSink:
    """Posts, edits and threads incident messages; see the module docstring."""

    name = "slack"
    coalesce = True
    solo_actions = ("plot",)  # the picture is its own step, retried on its own

    def __init__(
        self,
        settings: SlackSettings,
        alerts: AlertsConfig | None = None,
        *,
        timeout: float = 10.0,
        pace: float = PACE,
        plots: bool = True,
    ) -> None:
        from slack_sdk import WebClient
        from slack_sdk.webhook import WebhookClient

        self.settings = settings
        self.alerts = alerts or AlertsConfig()
        self.repeat_interval = self.alerts.repeat_interval
        self.pace = pace
        self.plots = plots
        self.calls = 0
        self.client: Any = None
        self.webhook: Any = None
        if settings.mode == "bot":
            self.client = WebClient(
                token=settings.token,
                base_url=settings.base_url,
                timeout=max(1, int(timeout)),
                retry_handlers=[],
            )
        else:
            self.webhook = WebhookClient(
                str(settings.webhook_url),
                timeout=max(1, int(timeout)),
                retry_handlers=[],
                logger=_QUIET,
            )
        # what this process posted, until the writer has stored it in `messages`
        self._posted: dict[int, Mapping[str, Any]] = {}
        self._last_sent: dict[int, float] = {}
        self._next_call: dict[str, float] = {}
        self._blocked: dict[str, float] = {}
        self._ids: dict[str, str] = {}
        self._lines: dict[int, str | None] = {}

    # -- policy ----------------------------------------------------------------------------------

    def delay(self, action: str) -> float:
        # updates wait for group_interval since the last message (see deliver), not a fixed delay
        return self.alerts.group_wait if action == "open" else 0.0

    def route(self, incident: Mapping[str, Any]) -> str:
        for r in self.settings.routes:
            if r.get("kinds") and incident.get("kind") not in r["kinds"]:
                continue
            if r.get("severities") and incident.get("severity") not in r["severities"]:
                continue
            runs = r.get("runs")
            if runs and not any(fnmatch.fnmatchcase(incident.get("run") or "", p) for p in runs):
                continue
            return str(r["channel"])
        return str(self.settings.channel or "")

    # -- reading (sender thread, read-only connection) -------------------------------------------

    def load(self, conn: sqlite3.Connection, incident_id: int) -> dict[str, Any] | None:
        inc = incident_dict(conn, incident_id)
        if inc is None:
            return None
        row = conn.execute(
            "SELECT channel, ts, updated_at FROM messages WHERE incident_id=? AND sink=?",
            (incident_id, self.name),
        ).fetchone()
        inc["_message"] = {"channel": row[0], "ts": row[1], "updated_at": row[2]} if row else None
        root = conn.execute(
            "SELECT root_event_id FROM incidents WHERE id=?", (incident_id,)
        ).fetchone()
        inc["_first_line"] = self._first_line(conn, root[0] if root else None)
        plot_pending = conn.execute(
            "SELECT 1 FROM outbox WHERE incident_id=? AND sink=? AND action='plot' "
            "AND delivered_at IS NULL",
            (incident_id, self.name),
        ).fetchone()
        if plot_pending:
            from .plot import metrics_for

            inc["_plot_rows"] = metrics_for(conn, inc)
        return inc

    def _first_line(self, conn: sqlite3.Connection, event_id: int | None) -> str | None:
        if event_id is None:
            return None
        if event_id in self._lines:
            return self._lines[event_id]
        row = conn.execute(
            "SELECT s.path, s.dev, s.ino, e.offset FROM events e JOIN sources s "
            "ON s.id = e.source_id WHERE e.id = ?",
            (event_id,),
        ).fetchone()
        line = None
        if row is not None:
            path, dev, ino, offset = row
            try:
                st = os.stat(path)
                # only the file the event came from (not a later file at the same path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read(4096)
                    line = data.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")
            except OSError:
                line = None
        self._lines[event_id] = line or None
        return line or None

    # -- delivery --------------------------------------------------------------------------------

    def deliver(
        self, row: Mapping[str, Any], incident: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        if not incident:
            return None  # removed by retention meanwhile
        iid = int(row["incident_id"])
        if row["action"] == "plot":
            return self._attach_plot(incident)
        rows = [row, *row.get("absorbed", [])]
        actions = {str(r["action"]) for r in rows}
        message: Mapping[str, Any] | None = self._posted.get(iid) or incident.get("_message")
        if message is None:
            opens = [float(r.get("due_at") or 0) for r in rows if r["action"] == "open"]
            if not opens:
                # never announced here (opened by a plain scan, or before Slack was configured)
                return None
            if row["action"] != "open" and min(opens) > time.time():
                raise Deferred("the incident's first message waits for group_wait", min(opens))
            if incident.get("status") != "open":
                return None  # resolved or merged before it was announced: nothing to tell
            return self._announce(incident)
        if actions == {"open"}:
            return None  # already posted (a replayed row)
        immediate = any((r.get("payload") or {}).get("immediate") for r in rows)
        if row["action"] == "update" and "resolve" not in actions and not immediate:
            last = self._last_sent.get(iid)
            if last is None and message.get("updated_at"):
                last = parse_utc(message["updated_at"])
            if last is not None and time.time() < last + self.alerts.group_interval:
                raise Deferred(
                    "group_interval since the last message", last + self.alerts.group_interval
                )
        news = merged_news(rows)
        remember: Mapping[str, Any] | None
        if self.client is not None:
            remember = self._edit(incident, message, news, actions)
        else:
            remember = self._webhook_follow_up(incident, news, actions)
        if remember is not None:
            self._last_sent[iid] = time.time()
        return remember

    def _announce(self, inc: Mapping[str, Any]) -> Mapping[str, Any]:
        iid = int(inc["id"])
        text = headline(inc)
        blocks = parent_blocks(inc, first_line=inc.get("_first_line"))
        if self.client is None:
            self._send_webhook(text, blocks)
            message = {"channel": "webhook"}
        else:
            channel = self.route(inc)
            resp = self._post(
                channel,
                text=text,
                blocks=blocks,
                metadata={"event_type": "nanwatch_incident", "event_payload": {"incident": iid}},
            )
            channel_id, ts = str(resp["channel"]), str(resp["ts"])
            message = {"channel": channel_id, "ts": ts}
            if channel not in self._ids:
                # pace by the channel's ID from now on, keeping the budget spent under its name
                self._ids[channel] = channel_id
                self._next_call[channel_id] = max(
                    self._next_call.get(channel_id, 0.0), self._next_call.pop(channel, 0.0)
                )
            self._posted[iid] = message
        self._last_sent[iid] = time.time()
        if self.plots and self.client is not None:
            return {"message": message, "then": ["plot"]}
        return {"message": message}

    def _edit(
        self,
        inc: Mapping[str, Any],
        message: Mapping[str, Any],
        news: list[str],
        actions: set[str],
    ) -> Mapping[str, Any]:
        channel, ts = str(message["channel"]), str(message["ts"])
        self._call(
            channel,
            "chat.update",
            self.client.chat_update,
            channel=channel,
            ts=ts,
            text=headline(inc),
            blocks=parent_blocks(inc, first_line=inc.get("_first_line")),
            link_names=False,
        )
        reply = follow_up(inc, news, actions)
        if reply is not None:
            self._post(channel, text=reply, blocks=None, thread_ts=ts)
        return {"message": {"channel": channel, "ts": ts}}

    def _post(self, channel: str, *, text: str, blocks: Any, **extra: Any) -> Any:
        kwargs = dict(
            channel=channel,
            text=text,
            blocks=blocks,
            unfurl_links=False,
            unfurl_media=False,
            link_names=False,
            **extra,
        )
        try:
            return self._call(channel, "chat.postMessage", self.client.chat_postMessage, **kwargs)
        except DeliveryError as e:
            if blocks is None or not any(b in str(e) for b in _BAD_MESSAGE):
                raise
            # Slack refused our blocks: the plain text still tells the story
            log.warning("Slack refused the message's blocks (%s); sending text only", e)
            kwargs["blocks"] = None
            return self._call(channel, "chat.postMessage", self.client.chat_postMessage, **kwargs)

    def _webhook_follow_up(
        self, inc: Mapping[str, Any], news: list[str], actions: set[str]
    ) -> Mapping[str, Any] | None:
        text = follow_up(inc, news, actions, standalone=True)
        if text is None:
            return None  # a webhook cannot edit: counts alone are not worth a post
        self._send_webhook(text, None)
        return {"message": {"channel": "webhook"}}

    # -- HTTP ------------------------------------------------------------------------------------

    def _gate(self, channel: str) -> str:
        """Per-channel budget: wait for the next slot, or hold the row while Slack said 429."""
        key = self._ids.get(channel, channel)
        now = time.monotonic()
        blocked = self._blocked.get(key, 0.0) - now
        if blocked > 0:
            raise Deferred(
                f"Slack asked to wait before posting to {channel}", time.time() + blocked
            )
        wait = self._next_call.get(key, 0.0) - now
        if wait > 0:
            time.sleep(wait)  # at most `pace` seconds
        self._next_call[key] = time.monotonic() + self.pace
        return key

    def _call(self, where: str, method: str, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        from slack_sdk.errors import SlackApiError, SlackClientError

        key = self._gate(where)
        self.calls += 1
        try:
            return fn(**kwargs)
        except SlackApiError as e:
            err = api_error(e, method, where)
            if err.retry_after is not None:
                self._blocked[key] = time.monotonic() + err.retry_after
            raise err from None
        except (OSError, http.client.HTTPException, SlackClientError) as e:
            raise DeliveryError(
                f"{method}: cannot reach Slack at {self.settings.base_url} ({e})"
            ) from None

    def _send_webhook(self, text: str, blocks: Any) -> None:
        key = self._gate("webhook")
        self.calls += 1
        try:
            resp = self.webhook.send(
                text=text, blocks=blocks, unfurl_links=False, unfurl_media=False
            )
        except (OSError, http.client.HTTPException) as e:
            raise DeliveryError(f"webhook: cannot reach the incoming webhook ({e})") from None
        status, body = int(resp.status_code), str(resp.body or "")
        if status == 200:
            return
        if status == 429:
            wait = retry_after(resp.headers)
            self._blocked[key] = time.monotonic() + wait
            raise DeliveryError(f"webhook: rate limited, Retry-After {wait:g}s", retry_after=wait)
        if status >= 500:
            raise DeliveryError(f"webhook: HTTP {status} {body}")
        if status in _WEBHOOK_FIX:
            raise DeliveryError(
                f"webhook: HTTP {status} {body}: the webhook was removed or its channel archived; "
                "create a new incoming webhook and update [slack] webhook_url_file",
                retry_after=FIX_RETRY,
            )
        if blocks is not None:
            log.warning("the webhook refused the message (%s %s); sending text only", status, body)
            return self._send_webhook(text, None)
        raise DeliveryError(f"webhook: HTTP {status} {body}", permanent=True)

    def _attach_plot(self, inc: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The incident's plot in its thread (files_upload_v2: get URL, upload, complete)."""
        message = self._posted.get(int(inc["id"])) or inc.get("_message")
        rows = inc.get("_plot_rows")
        if not message or not message.get("ts") or not rows:
            return None
        from .plot import PlotUnavailable, render_png

        try:
            png = render_png(inc, rows)
        except PlotUnavailable as e:
            log.info("incident %s: no plot (%s)", inc["id"], e)
            return None
        channel = str(message["channel"])
        self._call(
            channel,
            "files.upload",
            self.client.files_upload_v2,
            channel=channel,
            thread_ts=str(message["ts"]),
            file=png,
            filename=f"nanwatch-incident-{inc['id']}.png",
            title=f"Incident #{inc['id']}: loss, grad norm and step time per rank",
        )
        return None


# --- notify-test --------------------------------------------------------------------------------


def self_test(settings: SlackSettings, *, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Ask Slack who we are and whether each configured channel takes a message."""
    from slack_sdk import WebClient
    from slack_sdk.errors import SlackApiError
    from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
    from slack_sdk.webhook import WebhookClient

    from .slack_text import test_message

    steps: list[dict[str, Any]] = []
    target = settings.base_url if settings.mode == "bot" else "the incoming webhook"

    def failed(step: str, e: Exception, channel: str | None = None) -> dict[str, Any]:
        if isinstance(e, SlackApiError):
            err = api_error(e, step, channel)
            data = getattr(e.response, "data", None)
            code = data.get("error") if isinstance(data, dict) else None
            return {"step": step, "ok": False, "error": code or str(err), "detail": str(err)}
        return {
            "step": step,
            "ok": False,
            "error": "unreachable",
            "detail": f"cannot reach {target} ({e}); check the URL and the network",
        }

    if settings.mode == "webhook":
        hook = WebhookClient(
            str(settings.webhook_url),
            logger=_QUIET,
            timeout=max(1, int(timeout)),
            retry_handlers=[RateLimitErrorRetryHandler(max_retry_count=1)],
        )
        text, blocks = test_message("this incoming webhook")
        try:
            hook_resp = hook.send(text=text, blocks=blocks)
        except (OSError, http.client.HTTPException) as e:
            return [failed("webhook", e)]
        ok = hook_resp.status_code == 200
        return [
            {
                "step": "webhook",
                "ok": ok,
                "answer": f"HTTP {hook_resp.status_code} {hook_resp.body}",
                **({} if ok else {"detail": "the webhook refused the test message"}),
            }
        ]
    client = WebClient(
        token=settings.token,
        base_url=settings.base_url,
        timeout=max(1, int(timeout)),
        retry_handlers=[RateLimitErrorRetryHandler(max_retry_count=1)],
    )
    try:
        auth = client.auth_test()
        steps.append(
            {
                "step": "auth.test",
                "ok": True,
                "answer": {k: auth.get(k) for k in ("url", "team", "user", "bot_id", "team_id")},
            }
        )
    except (SlackApiError, OSError, http.client.HTTPException) as e:
        return [failed("auth.test", e)]
    channels = [c for c in [settings.channel, *(r["channel"] for r in settings.routes)] if c]
    for channel in dict.fromkeys(channels):
        if _CHANNEL_ID.match(channel):
            try:
                info = client.conversations_info(channel=channel).get("channel") or {}
                steps.append(
                    {
                        "step": "conversations.info",
                        "channel": channel,
                        "ok": True,
                        "answer": {
                            k: info.get(k)
                            for k in ("name", "is_member", "is_archived", "is_private")
                        },
                    }
                )
            except (SlackApiError, OSError, http.client.HTTPException) as e:
                steps.append({**failed("conversations.info", e, channel), "channel": channel})
                continue
        text, blocks = test_message(channel)
        try:
            resp = client.chat_postMessage(
                channel=channel, text=text, blocks=blocks, unfurl_links=False, link_names=False
            )
            steps.append(
                {
                    "step": "chat.postMessage",
                    "channel": channel,
                    "ok": True,
                    "answer": {"channel": resp.get("channel"), "ts": resp.get("ts")},
                }
            )
        except (SlackApiError, OSError, http.client.HTTPException) as e:
            steps.append({**failed("chat.postMessage", e, channel), "channel": channel})
    return steps
