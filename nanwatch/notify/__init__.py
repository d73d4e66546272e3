"""Stage 5: notification. Incident changes go through the outbox to sinks (console, Slack, ...)."""

from .outbox import Outbox, Sender, Sink

__all__ = ["Outbox", "Sender", "Sink"]
