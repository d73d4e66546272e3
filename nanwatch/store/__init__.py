"""Stage 3: the SQLite store (WAL, one writer, numbered migrations)."""

from .db import SCHEMA_VERSION, Store

__all__ = ["SCHEMA_VERSION", "Store"]
