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

import csv
import fnmatch
import http.client
import logging
import os
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..config import AlertsConfig
from ..errors import DeliveryError
from ..events import parse_utc
from ..store.outbox import OutboxStore
from ..store.records import JSON, Message, MessageRef, OutboxRow
from .outbox import Deferred, Posted
from .plot_rows import PlotRow
from .slack_api import (
    BAD_MESSAGE,
    CHANNEL_ID,
    FIX_RETRY,
    QUIET,
    WEBHOOK_FIX,
    SlackSettings,
    api_error,
    retry_after,
    slack_settings,
)
from .slack_text import details_text, follow_up, headline, merged_news, parent_blocks
from .view import incident_view

__all__ = ["PACE", "SlackSettings", "SlackSink", "slack_settings"]

SERVICE_CONFIG = "/etc/nanwatch/nanwatch.toml"  # where read commands look without flags

log = logging.getLogger("nanwatch.notify.slack")

PACE = 1.0  # seconds between calls to one channel (Slack: about one message per second)


def _csv_row(header: str, row: str) -> str:
    """A monitor CSV row with its column names: ``name=...; shape=[80, 256]; nan_count=3``."""
    try:
        names, values = list(csv.reader([header.rstrip("\r"), row]))
    except (csv.Error, ValueError):
        return row
    if len(names) != len(values):
        return row
    return "; ".join(f"{n}={v}" for n, v in zip(names, values) if v != "")


class SlackSink:
    """Posts, edits and threads incident messages; see the module docstring."""

    name = "slack"
    coalesce = True
    # the thread's details and the picture are steps of their own, retried on their own
    solo_actions = ("details", "plot")
    # best effort: a plot that failed this often is given up (the message is what matters)
    max_attempts: ClassVar[dict[str, int]] = {"plot": 5}

    def __init__(
        self,
        settings: SlackSettings,
        alerts: AlertsConfig | None = None,
        *,
        timeout: float = 10.0,
        pace: float = PACE,
        plots: bool = True,
        config_path: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        from slack_sdk import WebClient
        from slack_sdk.webhook import WebhookClient

        self.settings = settings
        self.alerts = alerts or AlertsConfig()
        self.repeat_interval = self.alerts.repeat_interval
        self.pace = pace
        self.plots = plots
        # wall time (group_wait/interval, Retry-After as a due time); the per-channel budget
        # runs on `monotonic` and waits with `sleep`
        self.clock = clock
        self.monotonic = monotonic
        self.sleep = sleep
        # `nanwatch show N` in a message finds the service's config by itself; another config
        # is named in the command
        where = os.fspath(config_path) if config_path else None
        self.config_path = where if where and where != SERVICE_CONFIG else None
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
                logger=QUIET,
            )
        # what this process posted, until the writer has stored it in `messages`
        self._posted: dict[int, MessageRef] = {}
        self._last_sent: dict[int, float] = {}
        self._next_call: dict[str, float] = {}
        self._blocked: dict[str, float] = {}
        self._ids: dict[str, str] = {}
        self._lines: dict[int, str | None] = {}
        # a first message due before this process started may have been posted by the previous
        # one, killed before it stored the message's ts: it is looked for before posting again
        self.started = clock()
        self._uid: str | None = None
        self._history_warned = False

    # -- policy ----------------------------------------------------------------------------------

    def delay(self, action: str) -> float:
        # updates wait for group_interval since the last message (see deliver), not a fixed delay
        return self.alerts.group_wait if action == "open" else 0.0

    def route(self, incident: Mapping[str, JSON]) -> str:
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

    def load(self, db: OutboxStore, incident_id: int) -> dict[str, JSON] | None:
        got = db.incident(incident_id)
        if got is None:
            return None
        record, run = got
        inc = incident_view(record, run)
        message = db.message(incident_id, self.name)
        inc["_message"] = message
        inc["_first_line"] = self._first_line(db, record.root_event_id)
        inc["_root_where"] = self._where(db, record.root_event_id)
        if self.config_path:
            inc["_config"] = self.config_path
        if self._uid is None:
            self._uid = db.uid()
        inc["_db"] = self._uid
        if message is None and self.client is not None:
            inc["_channel_id"] = self._known_id(db, self.route(inc))
        if db.waiting(incident_id, self.name, "plot"):
            inc["_plot_rows"] = _plot_rows(db, inc)
        return inc

    def _known_id(self, db: OutboxStore, channel: str) -> str | None:
        """The ID of a channel configured by name: learnt in this process, or from a message
        of another incident routed to it."""
        if CHANNEL_ID.match(channel):
            return channel
        if channel in self._ids:
            return self._ids[channel]
        for message, kind, severity, run in db.routed_messages(self.name):
            if self.route({"kind": kind, "severity": severity, "run": run}) == channel:
                return str(message.channel)
        return None

    @staticmethod
    def _where(db: OutboxStore, event_id: int | None) -> str | None:
        """``file:line`` of the root event (the file's name: the run names the folder)."""
        place = db.event_place(event_id) if event_id is not None else None
        if place is None:
            return None
        name = os.path.basename(place.path)
        return f"{name}:{place.line}" if place.line is not None else name

    def _first_line(self, db: OutboxStore, event_id: int | None) -> str | None:
        if event_id is None:
            return None
        if event_id in self._lines:
            return self._lines[event_id]
        place = db.event_place(event_id)
        line = None
        if place is not None:
            path, offset = place.path, place.offset
            try:
                st = os.stat(path)
                # only the file the event came from (not a later file at the same path)
                if (st.st_dev, st.st_ino) == (place.dev, place.ino):
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read(4096)
                        head = b""
                        if path.endswith(".csv") and offset > 0:
                            f.seek(0)
                            head = f.read(4096).split(b"\n", 1)[0]
                    line = data.split(b"\n", 1)[0].decode("utf-8", "replace").rstrip("\r")
                    if head:
                        line = _csv_row(head.decode("utf-8", "replace"), line)
            except OSError:
                line = None
        self._lines[event_id] = line or None
        return line or None

    # -- delivery --------------------------------------------------------------------------------

    def deliver(
        self,
        row: OutboxRow,
        incident: Mapping[str, JSON],
        absorbed: Sequence[OutboxRow] = (),
    ) -> Posted | None:
        if not incident or row.incident_id is None:
            return None  # removed by retention meanwhile
        iid = row.incident_id
        if row.action == "plot":
            return self._attach_plot(incident)
        if row.action == "details":
            return self._details(incident)
        rows = [row, *absorbed]
        actions = {r.action for r in rows}
        message = self._message(incident)
        if message is not None and self.client is not None:
            # after a restart: the channel's name and ID share one budget again
            self._learn_id(self.route(incident), str(message.channel))
        if message is None:
            opens = [r.due_at for r in rows if r.action == "open"]
            if not opens:
                # never announced here (opened by a plain scan, or before Slack was configured)
                return None
            if row.action != "open" and min(opens) > self.clock():
                raise Deferred("the incident's first message waits for group_wait", min(opens))
            if incident.get("status") != "open":
                return None  # resolved or merged before it was announced: nothing to tell
            return self._announce(incident, due=min(opens))
        if actions == {"open"}:
            return None  # already posted (a replayed row)
        immediate = any(r.payload.get("immediate") for r in rows)
        if row.action == "update" and "resolve" not in actions and not immediate:
            last = self._last_sent.get(iid)
            if last is None and isinstance(message, Message) and message.updated_at:
                last = parse_utc(message.updated_at)
            if last is not None and self.clock() < last + self.alerts.group_interval:
                raise Deferred(
                    "group_interval since the last message", last + self.alerts.group_interval
                )
        news = merged_news(rows)
        posted: Posted | None
        if self.client is not None:
            posted = self._edit(incident, message, news, actions)
        else:
            posted = self._webhook_follow_up(incident, news, actions)
        if posted is not None:
            self._last_sent[iid] = self.clock()
        return posted

    def _message(self, inc: Mapping[str, JSON]) -> MessageRef | Message | None:
        """The incident's parent message: posted by this process, or stored in ``messages``."""
        mine = self._posted.get(int(inc["id"]))
        stored: Message | None = inc.get("_message")
        return mine or stored

    def _announce(self, inc: Mapping[str, JSON], *, due: float = 0.0) -> Posted:
        iid = int(inc["id"])
        text = headline(inc)
        blocks = parent_blocks(inc, first_line=inc.get("_first_line"))
        if self.client is None:
            self._send_webhook(text, blocks)
            self._last_sent[iid] = self.clock()
            # a webhook has no thread: `nanwatch show` tells the rest
            return Posted(MessageRef("webhook"))
        channel = self.route(inc)
        found = self._posted_before(channel, inc, due) if due < self.started else None
        if found is not None:
            log.info("incident #%d: its message is already in %s (ts %s)", iid, *found)
            channel_id, ts = found
        else:
            resp = self._post(
                channel,
                text=text,
                blocks=blocks,
                metadata={
                    "event_type": "nanwatch_incident",
                    "event_payload": {"incident": iid, "db": inc.get("_db") or ""},
                },
            )
            channel_id, ts = str(resp["channel"]), str(resp["ts"])
        message = MessageRef(channel_id, ts)
        self._learn_id(channel, channel_id)
        self._posted[iid] = message
        self._last_sent[iid] = self.clock()
        return Posted(message, ("details", "plot") if self.plots else ("details",))

    def _details(self, inc: Mapping[str, JSON]) -> Posted | None:
        """The rest of the story (origin, first log line, every known cause) in the thread."""
        text = details_text(inc, first_line=inc.get("_first_line"))
        message = self._message(inc)
        if not message or not message.ts:
            return None
        self._post(str(message.channel), text=text, blocks=None, thread_ts=str(message.ts))
        return None

    def _posted_before(
        self, channel: str, inc: Mapping[str, JSON], due: float
    ) -> tuple[str, str] | None:
        """(channel ID, ts) of this incident's parent message if a previous process posted it
        (``conversations.history``, by the message's metadata), else None."""
        cid = inc.get("_channel_id")
        if not cid:
            return None  # a channel by name never posted to from this database: nothing to find
        want = {"incident": int(inc["id"]), "db": inc.get("_db") or ""}
        cursor = None
        for _page in range(5):
            try:
                resp = self._call(
                    channel,
                    "conversations.history",
                    self.client.conversations_history,
                    channel=cid,
                    oldest=f"{max(0.0, due - 60):.6f}",
                    limit=200,
                    include_all_metadata=True,
                    **({"cursor": cursor} if cursor else {}),
                )
            except DeliveryError as e:
                if e.retry_after is not None and e.retry_after != FIX_RETRY:
                    raise  # rate limited: the outbox tries again later
                if e.retry_after is None and not e.permanent:
                    raise  # Slack unreachable: posting would fail too
                # a scope missing for reading is no reason to stop posting to the channel
                self._blocked.pop(self._ids.get(channel, channel), None)
                if not self._history_warned:
                    self._history_warned = True
                    log.warning(
                        "cannot read %s's history to avoid posting twice after a restart (%s); "
                        "add the scope channels:history (groups:history for private channels)",
                        channel,
                        e,
                    )
                return None
            for m in resp.get("messages") or []:
                meta = m.get("metadata") or {}
                if (
                    meta.get("event_type") == "nanwatch_incident"
                    and (meta.get("event_payload") or {}) == want
                ):
                    return str(cid), str(m["ts"])
            cursor = (resp.get("response_metadata") or {}).get("next_cursor")
            if not cursor:
                return None
        return None

    def _edit(
        self,
        inc: Mapping[str, JSON],
        message: MessageRef | Message,
        news: list[str],
        actions: set[str],
    ) -> Posted:
        channel, ts = str(message.channel), str(message.ts)
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
        return Posted(MessageRef(channel, ts))

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
            if blocks is None or not any(b in str(e) for b in BAD_MESSAGE):
                raise
            # Slack refused our blocks: the plain text still tells the story
            log.warning("Slack refused the message's blocks (%s); sending text only", e)
            kwargs["blocks"] = None
            return self._call(channel, "chat.postMessage", self.client.chat_postMessage, **kwargs)

    def _webhook_follow_up(
        self, inc: Mapping[str, JSON], news: list[str], actions: set[str]
    ) -> Posted | None:
        text = follow_up(inc, news, actions, standalone=True)
        if text is None:
            return None  # a webhook cannot edit: counts alone are not worth a post
        self._send_webhook(text, None)
        return Posted(MessageRef("webhook"))

    # -- HTTP ---------------------------------------------------------------------------------

    def _learn_id(self, channel: str, channel_id: str) -> None:
        """Pace by the channel's ID from now on, keeping the budget spent under its name."""
        if channel in self._ids or channel == channel_id:
            return
        self._ids[channel] = channel_id
        self._next_call[channel_id] = max(
            self._next_call.get(channel_id, 0.0), self._next_call.pop(channel, 0.0)
        )

    def _gate(self, channel: str) -> str:
        """Per-channel budget: wait for the next slot, or hold the row while Slack said 429."""
        key = self._ids.get(channel, channel)
        now = self.monotonic()
        blocked = self._blocked.get(key, 0.0) - now
        if blocked > 0:
            raise Deferred(
                f"Slack asked to wait before posting to {channel}", self.clock() + blocked
            )
        wait = self._next_call.get(key, 0.0) - now
        if wait > 0:
            self.sleep(wait)  # at most `pace` seconds
        self._next_call[key] = self.monotonic() + self.pace
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
                self._blocked[key] = self.monotonic() + err.retry_after
            raise err from None
        except urllib.error.HTTPError as e:
            # Slack answered (an upload URL, an API method): it is reachable, the call failed
            raise DeliveryError(f"{method}: Slack answered HTTP {e.code} {e.reason}") from None
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
            self._blocked[key] = self.monotonic() + wait
            raise DeliveryError(f"webhook: rate limited, Retry-After {wait:g}s", retry_after=wait)
        if status >= 500:
            raise DeliveryError(f"webhook: HTTP {status} {body}")
        if status in WEBHOOK_FIX:
            raise DeliveryError(
                f"webhook: HTTP {status} {body}: the webhook was removed or its channel archived; "
                "create a new incoming webhook and update [slack] webhook_url_file",
                retry_after=FIX_RETRY,
            )
        if blocks is not None:
            log.warning("the webhook refused the message (%s %s); sending text only", status, body)
            return self._send_webhook(text, None)
        raise DeliveryError(f"webhook: HTTP {status} {body}", permanent=True)

    def _attach_plot(self, inc: Mapping[str, JSON]) -> Posted | None:
        """The incident's plot in its thread (files_upload_v2: get URL, upload, complete)."""
        message = self._message(inc)
        rows = inc.get("_plot_rows")
        if not message or not message.ts or not rows:
            return None
        from .plot import PlotUnavailable, render_png

        try:
            png = render_png(inc, rows)
        except PlotUnavailable as e:
            log.info("incident %s: no plot (%s)", inc["id"], e)
            return None
        channel = str(message.channel)
        self._call(
            channel,
            "files.upload",
            self.client.files_upload_v2,
            channel=channel,
            thread_ts=str(message.ts),
            file=png,
            filename=f"nanwatch-incident-{inc['id']}.png",
            title=f"Incident #{inc['id']}: loss, grad norm and step time per rank",
        )
        return None


def _plot_rows(db: OutboxStore, inc: Mapping[str, JSON]) -> list[PlotRow]:
    """The metric rows of the incident's plot (the plot module reads them on a connection)."""
    from .plot import metrics_for

    return metrics_for(db.store, inc)
