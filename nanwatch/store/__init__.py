"""Stage 3: the SQLite store (WAL, one writer, numbered migrations), and the fleet store.

``DatabaseError`` is the driver's error class, for the few callers that must tell a broken
database from everything else without importing the driver themselves.
"""

from sqlite3 import Error as DatabaseError

from .db import SCHEMA_VERSION, Store

__all__ = ["SCHEMA_VERSION", "DatabaseError", "Store"]
