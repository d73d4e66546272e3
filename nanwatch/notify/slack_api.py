"""Talking to Slack: the ``[slack]`` settings and their secret, Slack's errors sorted into
"retry", "a person must fix something" and "never", and the checks of `nanwatch notify-test`.

The secret (bot token or webhook URL) comes from a file that only its owner may read, or the
environment; it never comes from the command line, never appears in a repr, and the webhook
URL is kept out of slack_sdk's debug log.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .._dc import dataclass
from ..config import SLACK_TOKEN_CREDENTIAL, SLACK_WEBHOOK_CREDENTIAL, Config
from ..config import read_secret_file as read_secret
from ..errors import ConfigError, DeliveryError
from ..store.records import JSON

log = logging.getLogger("nanwatch.notify.slack")

DEFAULT_BASE_URL = "https://slack.com/api/"
TOKEN_ENV = "SLACK_BOT_TOKEN"
FIX_RETRY = 300.0  # seconds between tries while a person has to fix the app or channel

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
BAD_MESSAGE = {"invalid_blocks", "invalid_blocks_format", "msg_too_long", "too_many_blocks"}
WEBHOOK_FIX = {403: "action_prohibited", 404: "no_service", 410: "channel_is_archived"}


# slack_sdk logs a webhook's URL (a secret) at DEBUG; this logger never passes DEBUG on
QUIET = logging.getLogger("nanwatch.notify.slack.webhook")
QUIET.setLevel(logging.INFO)


# --- settings -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlackSettings:
    """What the sink needs, resolved from ``[slack]``; secrets never appear in repr."""

    channel: str | None = None
    base_url: str = DEFAULT_BASE_URL
    routes: tuple[Mapping[str, JSON], ...] = ()
    token: str | None = field(default=None, repr=False)
    webhook_url: str | None = field(default=None, repr=False)
    secret_source: str = ""  # where the secret came from, for messages

    @property
    def mode(self) -> str:
        return "webhook" if self.webhook_url else "bot"


def _where(config: Config) -> str:
    return f"{config.path or '<config>'}: [slack]"


def _credential(name: str) -> str | None:
    """``$CREDENTIALS_DIRECTORY/<name>`` (systemd LoadCredential=), stripped; None if absent."""
    folder = os.environ.get("CREDENTIALS_DIRECTORY")
    if not folder:
        return None
    try:
        value = (Path(folder) / name).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


def slack_settings(config: Config) -> SlackSettings | None:
    """``[slack]`` with its secret read; None without the section; ConfigError if unusable."""
    sc = config.slack
    if not sc.enabled:
        return None
    where = _where(config)
    base_url = sc.base_url or DEFAULT_BASE_URL
    if not base_url.endswith("/"):
        base_url += "/"
    credential_token = None
    credential_hook = None
    if not (sc.token_file or sc.webhook_url_file or sc.webhook_url):
        # what systemd's LoadCredential= passes the service (the unit's empty default: absent)
        credential_token = _credential(SLACK_TOKEN_CREDENTIAL)
        if credential_token is None:
            credential_hook = _credential(SLACK_WEBHOOK_CREDENTIAL)
    if sc.webhook_url_file or sc.webhook_url or credential_hook:
        if credential_hook:
            url, source = credential_hook, f"credential {SLACK_WEBHOOK_CREDENTIAL}"
        elif sc.webhook_url_file:
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
    elif credential_token:
        token, source = credential_token, f"credential {SLACK_TOKEN_CREDENTIAL}"
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


CHANNEL_ID = re.compile(r"^[CGD][A-Z0-9]{6,}$")


# --- notify-test --------------------------------------------------------------------------------


def self_test(settings: SlackSettings, *, timeout: float = 10.0) -> list[dict[str, JSON]]:
    """Ask Slack who we are and whether each configured channel takes a message."""
    from slack_sdk import WebClient
    from slack_sdk.errors import SlackApiError
    from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
    from slack_sdk.webhook import WebhookClient

    from .slack_text import test_message

    steps: list[dict[str, JSON]] = []
    target = settings.base_url if settings.mode == "bot" else "the incoming webhook"

    def failed(step: str, e: Exception, channel: str | None = None) -> dict[str, JSON]:
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
            logger=QUIET,
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
        if CHANNEL_ID.match(channel):
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
