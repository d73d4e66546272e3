"""A node's side of fleet mode: forward what it committed to the fleet store.

Called after every pass of ``watch`` (at most once per ``min_interval``, and at least once per
heartbeat even when nothing happened, so the correlator knows the node is alive) and at the
end of ``scan``. A fleet store that cannot be reached loses nothing: the events wait in the
node's database (the forward cursor has not moved) and go with the next forward; the pass and
the scan go on, and the report says how many wait.
"""

from __future__ import annotations

import logging
import socket

from ..config import FLEET_PASSWORD_CREDENTIAL, Config, read_secret
from ..errors import NanwatchError
from ..store.db import Store
from ..store.fleet import FleetStore, ForwardReport, waiting

__all__ = ["Forwarder", "fleet_password"]

log = logging.getLogger("nanwatch.fleet")


def fleet_password(config: Config) -> str | None:
    """The fleet store's password: password_file, LoadCredential=fleet-password, or None
    (libpq then reads PGPASSWORD or ~/.pgpass itself)."""
    return read_secret(
        file=config.fleet.password_file,
        credential=FLEET_PASSWORD_CREDENTIAL,
        env=None,
        key="[fleet] password_file",
    )


class Forwarder:
    """Keeps one connection to the fleet store and reconnects when it broke."""

    def __init__(self, config: Config, *, node: str, min_interval: float = 1.0) -> None:
        if not config.fleet.dsn:
            raise ValueError("Forwarder needs [fleet] dsn")
        self.dsn = config.fleet.dsn
        self.password = fleet_password(config)
        self.heartbeat = config.fleet.heartbeat
        self.node = node
        self.host = socket.gethostname()
        self.min_interval = min_interval
        self._fleet: FleetStore | None = None
        self._last = float("-inf")
        self._retry_at = float("-inf")
        self._backoff = 0.0
        self.last_error: str | None = None

    def due(self, now: float, *, committed: bool) -> bool:
        if now < self._retry_at:
            return False  # the store was unreachable: wait for the back-off step
        if now - self._last >= self.heartbeat or now < self._last:
            return True
        return committed and now - self._last >= self.min_interval

    def forward(self, store: Store, *, now: float) -> ForwardReport:
        self._last = now
        try:
            if self._fleet is None:
                self._fleet = FleetStore.connect(self.dsn, password=self.password, timeout=2.0)
            report = self._fleet.forward(
                store, node=self.node, host=self.host, now=now, heartbeat=self.heartbeat
            )
        except NanwatchError as e:
            self.close()
            report = ForwardReport(error=str(e), waiting=waiting(store))
            if report.error != self.last_error:
                log.warning("%s; %d event(s) wait to be forwarded", e, report.waiting)
            # 1 s, 2 s, 4 s ... up to a heartbeat: a down store costs the writer little
            self._backoff = min(self.heartbeat, self._backoff * 2 if self._backoff else 1.0)
            self._retry_at = now + self._backoff
        else:
            self._backoff, self._retry_at = 0.0, float("-inf")
        self.last_error = report.error
        return report

    def close(self) -> None:
        if self._fleet is not None:
            self._fleet.close()
            self._fleet = None
