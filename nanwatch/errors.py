"""The exception tree. Library code raises these; only the CLI turns them into messages.

::

    NanwatchError                 every error nanwatch raises on purpose
     ├── ConfigError              a config file, key or value that cannot work
     │    └── RuleError           a broken rule pack or knowledge entry
     ├── SourceError              a path that cannot be followed (missing, not readable)
     ├── StoreError               the database cannot be opened, migrated or written
     └── DeliveryError            a notification sink refused or could not take a message

Every message says what went wrong, where (file / key / rule) and how to fix it.
"""

from __future__ import annotations


class NanwatchError(Exception):
    """Root of nanwatch's exceptions."""


class ConfigError(NanwatchError):
    """Bad configuration: the message names the file, the key and the fix."""


class RuleError(ConfigError):
    """A rule pack or knowledge-base entry cannot be loaded."""


class SourceError(NanwatchError):
    """A path given to scan/watch cannot be followed."""


class StoreError(NanwatchError):
    """The SQLite store cannot be opened, migrated or written. ``damaged``: its file is
    corrupt, and no retry or restart can help (the message gives the recovery steps)."""

    def __init__(self, message: str, *, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


class DeliveryError(NanwatchError):
    """A notification could not be delivered (may be retried)."""

    def __init__(self, message: str, *, retry_after: float | None = None, permanent: bool = False):
        super().__init__(message)
        self.retry_after = retry_after
        self.permanent = permanent
