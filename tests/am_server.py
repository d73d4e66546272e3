"""A loopback HTTP catcher: what nanwatch posts to Alertmanager (or Alertmanager to Slack).

Real HTTP on 127.0.0.1; tests script the status codes it answers with, stop it to simulate
an outage, and read back every request body. ``stop()`` joins its thread.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Catcher:
    def __init__(self, *, status: int = 200) -> None:
        self.status = status
        self.faults: list[int] = []  # statuses for the next requests, then `status`
        self.posts: list[tuple[str, Any]] = []  # (path, parsed JSON body)
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Catcher:
        catcher = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(size)
                try:
                    body: Any = json.loads(raw or b"null")
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                with catcher.lock:
                    status = catcher.faults.pop(0) if catcher.faults else catcher.status
                    if status < 300:
                        catcher.posts.append((self.path, body))
                payload = b"" if status < 300 else b'{"message": "scripted failure"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="catcher"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def alerts(self) -> list[dict[str, Any]]:
        """Every alert posted to /api/v2/alerts, in order."""
        with self.lock:
            return [a for path, body in self.posts if path.endswith("/alerts") for a in body]

    def __enter__(self) -> Catcher:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
