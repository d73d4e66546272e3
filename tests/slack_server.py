"""A small Slack on loopback: the Web API methods nanwatch uses, plus incoming webhooks.

It speaks real HTTP, so slack_sdk's WebClient and WebhookClient talk to it through
``base_url`` / the webhook URL, exactly as they talk to Slack. Tests script failures
(HTTP 429 with Retry-After, ``ok:false`` errors, 5xx), stop it to simulate an outage and start
it again on the same port, and read back every call it received.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKEN = "xoxb-test-0123456789-nanwatch"


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    headers: dict[str, str]
    at: float  # time.monotonic()
    status: int = 200
    body: bytes = b""


@dataclass
class Fault:
    status: int = 200
    error: str | None = None
    retry_after: float | None = None
    times: int = 1


@dataclass
class Message:
    channel: str
    ts: str
    text: str
    blocks: Any
    thread_ts: str | None
    edits: list[dict[str, Any]] = field(default_factory=list)
    metadata: Any = None


DETAILS = "*Origin:*"  # how nanwatch's details reply starts


class SlackServer:
    """Start with ``start()`` (or use as a context manager); ``stop()`` joins its thread."""

    def __init__(self, *, token: str = TOKEN, port: int = 0) -> None:
        self.token = token
        self.port = port
        self.calls: list[Call] = []
        self.messages: list[Message] = []
        self.uploads: dict[str, bytes] = {}
        self.webhook_posts: list[dict[str, Any]] = []
        self.faults: dict[str, list[Fault]] = {}
        self.missing_channels: set[str] = set()
        self.missing_scopes: set[str] = set()
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._n = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> SlackServer:
        server = self

        class Handler(_Handler):
            slack = server

        self._httpd = _Server(("127.0.0.1", self.port), Handler)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="slack-server"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._httpd = self._thread = None

    def __enter__(self) -> SlackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextmanager
    def down(self) -> Iterator[None]:
        """An outage: nothing listens on the port until the block ends."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/"

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/services/T0000/B0000/hook"

    # -- scripting and reading back --------------------------------------------------------------

    def fail(
        self,
        method: str,
        *,
        status: int = 200,
        error: str | None = None,
        retry_after: float | None = None,
        times: int = 1,
    ) -> None:
        with self.lock:
            self.faults.setdefault(method, []).append(Fault(status, error, retry_after, times))

    def calls_to(self, method: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.method == method]

    def parents(self) -> list[Message]:
        with self.lock:
            return [m for m in self.messages if m.thread_ts is None]

    def replies(self, ts: str) -> list[Message]:
        """The thread's news replies (the details reply every parent gets first is apart)."""
        with self.lock:
            return [
                m for m in self.messages if m.thread_ts == ts and not m.text.startswith(DETAILS)
            ]

    def details(self, ts: str) -> list[Message]:
        """The thread's details replies (origin, first log line, every known cause)."""
        with self.lock:
            return [m for m in self.messages if m.thread_ts == ts and m.text.startswith(DETAILS)]

    def channel_id(self, channel: str) -> str:
        if channel.startswith("#"):
            return "C" + format(zlib.crc32(channel.encode()), "08X") + "Z"
        return channel

    def next_ts(self) -> str:
        self._n += 1
        return f"{1_800_000_000 + self._n}.{self._n:06d}"

    # -- the API ---------------------------------------------------------------------------------

    def handle(self, method: str, params: dict[str, Any], auth: str | None) -> tuple[int, Any]:
        with self.lock:
            queue = self.faults.get(method) or []
            if queue:
                fault = queue[0]
                fault.times -= 1
                if fault.times <= 0:
                    queue.pop(0)
                body = {"ok": False, "error": fault.error or "ratelimited"}
                return fault.status, (body, fault.retry_after)
        if method.startswith("services/"):
            with self.lock:
                self.webhook_posts.append(params)
            return 200, "ok"
        if method.startswith("upload/"):
            return 200, "OK"
        if auth != f"Bearer {self.token}":
            return 200, {"ok": False, "error": "invalid_auth" if auth else "not_authed"}
        fn = getattr(self, "api_" + method.replace(".", "_"), None)
        if fn is None:
            return 200, {"ok": False, "error": "unknown_method"}
        with self.lock:
            return 200, fn(params)

    def api_auth_test(self, p: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "url": "https://nanwatch-test.slack.com/",
            "team": "nanwatch test",
            "user": "nanwatch",
            "team_id": "T0000",
            "user_id": "U0000",
            "bot_id": "B0000",
        }

    def api_conversations_info(self, p: dict[str, Any]) -> dict[str, Any]:
        ch = str(p.get("channel"))
        if ch in self.missing_channels:
            return {"ok": False, "error": "channel_not_found"}
        return {
            "ok": True,
            "channel": {"id": ch, "name": "alerts", "is_member": True, "is_archived": False},
        }

    def api_chat_postMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        ch = str(p.get("channel"))
        if ch in self.missing_channels:
            return {"ok": False, "error": "channel_not_found"}
        cid = self.channel_id(ch)
        thread = p.get("thread_ts")
        if thread and not any(m.ts == thread and m.thread_ts is None for m in self.messages):
            return {"ok": False, "error": "thread_not_found"}
        m = Message(cid, self.next_ts(), str(p.get("text") or ""), p.get("blocks"), thread)
        meta = p.get("metadata")
        m.metadata = json.loads(meta) if isinstance(meta, str) else meta
        self.messages.append(m)
        return {"ok": True, "channel": cid, "ts": m.ts, "message": {"text": m.text}}

    def api_conversations_history(self, p: dict[str, Any]) -> dict[str, Any]:
        ch = str(p.get("channel"))
        if not ch.startswith("C"):
            return {"ok": False, "error": "channel_not_found"}  # IDs only, as Slack
        if "history" in self.missing_scopes:
            return {"ok": False, "error": "missing_scope", "needed": "channels:history"}
        oldest = float(p.get("oldest") or 0)
        limit = int(p.get("limit") or 100)
        start = int(p.get("cursor") or 0)
        found = [
            m
            for m in reversed(self.messages)  # newest first
            if m.channel == ch and m.thread_ts is None and float(m.ts) > oldest
        ]
        page = found[start : start + limit]
        with_meta = str(p.get("include_all_metadata")).lower() in ("1", "true")
        out = []
        for m in page:
            item: dict[str, Any] = {"type": "message", "ts": m.ts, "text": m.text}
            if with_meta and m.metadata:
                item["metadata"] = m.metadata
            out.append(item)
        more = start + limit < len(found)
        return {
            "ok": True,
            "messages": out,
            "has_more": more,
            "response_metadata": {"next_cursor": str(start + limit) if more else ""},
        }

    def api_chat_update(self, p: dict[str, Any]) -> dict[str, Any]:
        for m in self.messages:
            if m.channel == p.get("channel") and m.ts == p.get("ts"):
                m.edits.append({"text": p.get("text"), "blocks": p.get("blocks")})
                m.text = str(p.get("text") or "")
                m.blocks = p.get("blocks")
                return {"ok": True, "channel": m.channel, "ts": m.ts}
        return {"ok": False, "error": "message_not_found"}

    def api_files_getUploadURLExternal(self, p: dict[str, Any]) -> dict[str, Any]:
        fid = f"F{len(self.uploads) + 1:08d}"
        self.uploads[fid] = b""
        return {
            "ok": True,
            "file_id": fid,
            "upload_url": f"http://127.0.0.1:{self.port}/upload/{fid}",
        }

    def api_files_completeUploadExternal(self, p: dict[str, Any]) -> dict[str, Any]:
        files = json.loads(p.get("files") or "[]")
        missing = [f["id"] for f in files if not self.uploads.get(f["id"])]
        if missing:
            return {"ok": False, "error": "file_not_uploaded"}
        thread = p.get("thread_ts")
        cid = str(p.get("channel_id"))
        for f in files:
            m = Message(cid, self.next_ts(), f"file {f['id']}", None, thread)
            self.messages.append(m)
        return {"ok": True, "files": [{"id": f["id"], "title": f.get("title")} for f in files]}


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True  # restart on the same port after an outage
    daemon_threads = False  # server_close() joins the request threads


class _Handler(BaseHTTPRequestHandler):
    slack: SlackServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        params: dict[str, Any] = {k: v[-1] for k, v in parse_qs(url.query).items()}
        ctype = self.headers.get("Content-Type") or ""
        if "json" in ctype and raw:
            params.update(json.loads(raw))
        elif "x-www-form-urlencoded" in ctype and raw and not url.path.startswith("/upload/"):
            params.update({k: v[-1] for k, v in parse_qs(raw.decode()).items()})
        path = url.path.lstrip("/")
        method = path[len("api/") :] if path.startswith("api/") else path
        call = Call(method, params, dict(self.headers.items()), time.monotonic(), body=raw)
        if method.startswith("upload/"):
            with self.slack.lock:
                self.slack.uploads[method.split("/", 1)[1]] = raw
        status, payload = self.slack.handle(method, params, self.headers.get("Authorization"))
        call.status = status
        with self.slack.lock:
            self.slack.calls.append(call)
        headers = {}
        if isinstance(payload, tuple):
            payload, retry_after = payload
            if retry_after is not None:
                headers["Retry-After"] = f"{retry_after:g}"
            if method.startswith("services/"):
                payload = payload["error"]  # webhooks answer in plain text
        if isinstance(payload, str):
            body = payload.encode()
            headers["Content-Type"] = "text/plain"
        else:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json; charset=utf-8"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
