"""The Alertmanager sink: every incident is one alert on ``/api/v2/alerts``.

Each node's daemon tells Alertmanager about its own incidents; Alertmanager groups the alerts
of one training job (``group_by: [job, run]``), and its inhibition rules let the rank that
failed first (an ``oom`` or ``process_failure`` alert) mute the collective timeouts it caused on
every other node (``systemd/alertmanager-example.yml``). nanwatch never waits ``group_wait``:
Alertmanager groups by itself.

- **Labels**: ``alertname`` (per kind), ``kind``, ``job``, ``run`` (cluster-wide, see
  ``sources/identity.py``), ``node``, ``rank`` (the origin's), ``cause_rank`` (a root cause's own
  rank; for a timeout whose root lives on another node, the remote rank it names),
  ``severity`` and ``incident`` (its id on that node, so two incidents never share an alert).
- **Annotations**: ``summary`` (the title), ``root_cause``, ``hint`` (the top known cause and
  its first command), ``command`` (``nanwatch show ID``, on which node), ``ranks``.
- **Lifecycle**: an open incident is re-sent every ``RESEND`` seconds with ``endsAt`` a few
  re-sends ahead (what Prometheus does), so Alertmanager keeps it firing without depending on
  its ``resolve_timeout`` and lets it lapse only if this daemon goes away; a resolved incident,
  or one merged into another, is sent once more with ``endsAt`` = when that happened. Ending a
  `scan` never ends an alert. When an incident's labels change (its job became known later),
  the alert under the old labels is ended in the same request.
- **HA**: with several URLs (an Alertmanager cluster) every alert goes to each of them, as
  Prometheus does; delivery counts as done when one of them took it (the next re-send reaches
  the others), and is retried through the outbox when none did.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence

from ..errors import DeliveryError
from ..events import format_utc, parse_utc
from ..render import ranks_text
from ..store.outbox import OutboxStore
from ..store.records import JSON, MessageRef, OutboxRow
from .outbox import Posted
from .view import load_incident

log = logging.getLogger("nanwatch.notify.alertmanager")

RESEND = 60.0  # seconds between re-sends of an open incident's alert
LIFETIME = 4 * RESEND  # endsAt of a firing alert: it survives three missed re-sends
RETRY = 15.0  # seconds between tries while no Alertmanager answers

ALERTNAMES = {
    "nan": "NanwatchNonFinite",
    "overflow": "NanwatchLossScaleOverflow",
    "comm_timeout": "NanwatchCollectiveTimeout",
    "comm_error": "NanwatchCollectiveError",
    "oom": "NanwatchOutOfMemory",
    "process_failure": "NanwatchProcessFailure",
    "slowdown": "NanwatchSlowdown",
    "data_issue": "NanwatchDataIssue",
}


def api_url(url: str) -> str:
    """``http://am:9093`` -> ``http://am:9093/api/v2/alerts`` (a full API URL is kept)."""
    base = url.rstrip("/")
    return base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts"


def redact(url: str) -> str:
    """The URL without its credentials, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def request(url: str, *, data: bytes | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(HTTP status, body). Loopback goes direct; other hosts honour $HTTP(S)_PROXY / $NO_PROXY.
    Credentials in the URL (``http://user:pass@am:9093``) become a basic Authorization header."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if parts.username is not None:
        pair = (
            f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        )
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        host = parts.hostname or ""
        url = urllib.parse.urlunsplit(
            parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))
        )
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    handlers = [urllib.request.ProxyHandler({})] if _loopback(parts.hostname) else []
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(req, timeout=timeout) as resp:
            return int(resp.status), resp.read(1 << 16)
    except urllib.error.HTTPError as e:
        return int(e.code), e.read(1 << 16)


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def labels_of(inc: Mapping[str, JSON], *, node: str | None = None) -> dict[str, str]:
    """The label set of an incident's alert (every value a string: Alertmanager's model)."""
    origin = inc.get("origin") or {}
    detail = inc.get("detail") or {}
    kind = str(inc.get("kind") or "")
    rank = origin.get("rank")
    cause = rank
    if kind in ("comm_timeout", "comm_error") and detail.get("cause_rank") is not None:
        cause = detail["cause_rank"]  # the rank this node's ranks waited for
    elif kind in ("comm_timeout", "comm_error"):
        cause = None  # the rank that failed first is not in these logs
    job = inc.get("job") or inc.get("run") or "unknown"
    return {
        "alertname": ALERTNAMES.get(kind, "NanwatchIncident"),
        "kind": kind,
        "job": str(job),
        "run": str(inc.get("cluster_run") or job),
        "node": str(inc.get("node") or node or "unknown"),
        "rank": "unknown" if rank is None else str(rank),
        "cause_rank": "unknown" if cause is None else str(cause),
        "severity": str(inc.get("severity") or "critical"),
        "incident": str(inc.get("id")),
    }


def annotations_of(inc: Mapping[str, JSON], labels: Mapping[str, str]) -> dict[str, str]:
    detail = inc.get("detail") or {}
    out = {
        "summary": str(inc.get("title") or inc.get("kind")),
        "root_cause": str(detail.get("root_cause") or inc.get("title") or ""),
        "ranks": ranks_text(inc.get("ranks") or []),
        "command": f"nanwatch show {inc.get('id')}   (on {labels['node']})",
    }
    hints = inc.get("hints") or []
    if hints:
        top = hints[0]
        text = str(top.get("title") or "")
        commands = top.get("commands") or []
        if commands:
            text += f": $ {commands[0]}"
        out["hint"] = text
    if inc.get("run"):
        out["local_run"] = str(inc["run"])
    if inc.get("first_time"):
        out["first_time"] = str(inc["first_time"])
    return {k: v[:2000] for k, v in out.items() if v}


class AlertmanagerSink:
    """Delivers incidents to one Alertmanager or an HA group (see the module docstring)."""

    name = "alertmanager"
    coalesce = True  # one request carries an incident's state after many queued changes
    repeat_interval = RESEND  # the outbox queues a re-send of open incidents this often

    def __init__(
        self,
        urls: Sequence[str],
        *,
        node: str | None = None,
        timeout: float = 5.0,
        lifetime: float = LIFETIME,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.urls = [api_url(u) for u in urls]
        self.node = node
        self.timeout = timeout
        self.lifetime = lifetime
        self.clock = clock

    def delay(self, action: str) -> float:
        return 0.0  # no group_wait: Alertmanager groups by itself

    def load(self, db: OutboxStore, incident_id: int) -> dict[str, JSON] | None:
        inc = load_incident(db, incident_id)
        if inc is None:
            return None
        # the labels it was last sent under are kept as the message's "ts"
        message = db.message(incident_id, self.name)
        inc["_sent"] = json.loads(message.ts) if message and message.ts else None
        return inc

    def deliver(
        self,
        row: OutboxRow,
        incident: Mapping[str, JSON],
        absorbed: Sequence[OutboxRow] = (),
    ) -> Posted | None:
        if not incident:
            return None  # removed by retention meanwhile
        labels = labels_of(incident, node=self.node)
        sent = incident.get("_sent")
        now = self.clock()
        start = _ts(incident.get("created_at")) or now
        alerts: list[dict[str, JSON]] = []
        if sent and sent != labels:
            # the incident's job or run became known (or changed): end the old alert
            alerts.append({"labels": sent, "startsAt": _rfc(start), "endsAt": _rfc(now)})
        if incident.get("status") == "open":
            ends = now + self.lifetime
        elif sent:
            ends = max(start, _ts(incident.get("resolved_at")) or now)
        else:
            return None  # resolved or merged before it was ever told: nothing to end
        alerts.append(
            {
                "labels": labels,
                "annotations": annotations_of(incident, labels),
                "startsAt": _rfc(start),
                "endsAt": _rfc(ends),
            }
        )
        self.post(alerts)
        return Posted(MessageRef(self.name, json.dumps(labels, sort_keys=True)))

    def post(self, alerts: list[dict[str, JSON]]) -> None:
        """POST to every Alertmanager; done when one took it (see the module docstring)."""
        body = json.dumps(alerts).encode()
        errors: list[str] = []
        refused: list[str] = []
        for url in self.urls:
            try:
                code, answer = request(url, data=body, timeout=self.timeout)
            except (OSError, ValueError) as e:
                errors.append(f"{redact(url)}: {getattr(e, 'reason', None) or e}")
                continue
            if 200 <= code < 300:
                continue
            text = answer.decode("utf-8", "replace").strip()[:300]
            if code in (400, 422):
                refused.append(f"{redact(url)}: HTTP {code} {text}")
            else:
                errors.append(f"{redact(url)}: HTTP {code} {text}")
        took = len(self.urls) - len(errors) - len(refused)
        if took > 0:
            for problem in errors + refused:
                log.warning("alertmanager: %s (the others took the alert)", problem)
            return
        if refused and not errors:
            raise DeliveryError(
                "Alertmanager refused the alert: " + "; ".join(refused), permanent=True
            )
        raise DeliveryError(
            "no Alertmanager took the alert: " + "; ".join(errors + refused), retry_after=RETRY
        )


def _ts(text: JSON) -> float | None:
    if not text:
        return None
    try:
        return parse_utc(str(text))
    except ValueError:
        return None


def _rfc(ts: float) -> str:
    return format_utc(ts)
