"""Numbered schema migrations. ``PRAGMA user_version`` is the number of the last one applied.

A migration is appended, never edited once released.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from .metrics import rows_to_blocks

# SQL text, or a function of the connection for a change SQL alone cannot make
MIGRATIONS: list[str | Callable[[sqlite3.Connection], None]] = [
    # 1: the whole pipeline: runs, sources/offsets, events, metrics, incidents, outbox.
    """
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        root TEXT NOT NULL,
        launch TEXT NOT NULL DEFAULT '',
        experiment TEXT,
        job TEXT,
        node TEXT,
        created_at TEXT NOT NULL,
        first_time TEXT,
        last_time TEXT,
        facts TEXT NOT NULL DEFAULT '{}'
    );
    CREATE UNIQUE INDEX runs_root_launch ON runs(root, launch);

    CREATE TABLE sources (
        id INTEGER PRIMARY KEY,
        run_id INTEGER REFERENCES runs(id),
        path TEXT NOT NULL,
        root TEXT NOT NULL,
        dev INTEGER NOT NULL,
        ino INTEGER NOT NULL,
        gen INTEGER NOT NULL DEFAULT 0,
        offset INTEGER NOT NULL DEFAULT 0,
        head_hash TEXT,
        head_len INTEGER NOT NULL DEFAULT 0,
        tail_hash TEXT,
        cutting INTEGER NOT NULL DEFAULT 0,
        lines_cut INTEGER NOT NULL DEFAULT 0,
        status TEXT NOT NULL DEFAULT 'active',
        ctx TEXT,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    );
    CREATE UNIQUE INDEX sources_identity ON sources(dev, ino, gen);
    CREATE INDEX sources_status ON sources(status);

    CREATE TABLE events (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL,
        time TEXT,
        ingested_at TEXT NOT NULL,
        run_id INTEGER REFERENCES runs(id),
        source_id INTEGER REFERENCES sources(id),
        offset INTEGER NOT NULL,
        key TEXT NOT NULL DEFAULT '',
        line INTEGER,
        rank INTEGER,
        local_rank INTEGER,
        node TEXT,
        epoch INTEGER,
        iter INTEGER,
        step INTEGER,
        stage TEXT,
        device TEXT,
        message TEXT NOT NULL,
        fields TEXT NOT NULL DEFAULT '{}',
        incident_id INTEGER
    );
    CREATE UNIQUE INDEX events_identity ON events(source_id, offset, key);
    CREATE INDEX events_kind ON events(kind, id);
    CREATE INDEX events_run ON events(run_id, kind, id);
    CREATE INDEX events_incident ON events(incident_id, id);

    CREATE TABLE metrics (
        id INTEGER PRIMARY KEY,
        run_id INTEGER REFERENCES runs(id),
        source_id INTEGER REFERENCES sources(id),
        offset INTEGER NOT NULL,
        rank INTEGER,
        step INTEGER,
        epoch INTEGER,
        iter INTEGER,
        stage TEXT,
        time TEXT,
        loss REAL,
        grad_norm REAL,
        step_time REAL,
        data_time REAL,
        lr REAL,
        memory REAL
    );
    CREATE UNIQUE INDEX metrics_identity ON metrics(source_id, offset);
    CREATE INDEX metrics_run ON metrics(run_id, rank, step);

    CREATE TABLE incidents (
        id INTEGER PRIMARY KEY,
        run_id INTEGER REFERENCES runs(id),
        kind TEXT NOT NULL,
        key TEXT NOT NULL,
        title TEXT NOT NULL,
        status TEXT NOT NULL DEFAULT 'open',
        severity TEXT NOT NULL DEFAULT 'critical',
        ranks TEXT NOT NULL DEFAULT '[]',
        first_time TEXT,
        last_time TEXT,
        event_count INTEGER NOT NULL DEFAULT 0,
        origin TEXT NOT NULL DEFAULT '{}',
        hints TEXT NOT NULL DEFAULT '[]',
        detail TEXT NOT NULL DEFAULT '{}',
        root_event_id INTEGER,
        version INTEGER NOT NULL DEFAULT 1,
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        resolved_at TEXT
    );
    CREATE INDEX incidents_run ON incidents(run_id, kind, status);
    CREATE INDEX incidents_status ON incidents(status, id);

    CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        incident_id INTEGER,
        sink TEXT NOT NULL,
        action TEXT NOT NULL,
        payload TEXT NOT NULL DEFAULT '{}',
        dedup_key TEXT NOT NULL UNIQUE,
        created_at TEXT NOT NULL,
        due_at REAL NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        last_error TEXT,
        delivered_at TEXT
    );
    CREATE INDEX outbox_pending ON outbox(sink, delivered_at, due_at);

    CREATE TABLE messages (
        incident_id INTEGER NOT NULL,
        sink TEXT NOT NULL,
        channel TEXT,
        ts TEXT,
        thread_ts TEXT,
        posted_at TEXT NOT NULL,
        updated_at TEXT,
        PRIMARY KEY (incident_id, sink)
    );

    CREATE TABLE silences (
        id INTEGER PRIMARY KEY,
        run TEXT,
        kind TEXT,
        until REAL NOT NULL,
        created_at TEXT NOT NULL,
        comment TEXT
    );

    CREATE TABLE meta (
        key TEXT PRIMARY KEY,
        value TEXT
    );
    """,
    # 2: many nodes. Why each change:
    # - runs.cluster_run: the launch's name every node agrees on (the `run` label; runs.job is
    #   the `job` one); NULL with job when nothing cluster-wide is known.
    # - sources.node: file identity (dev, inode) is only unique on one node, so a database that
    #   holds several nodes' files (`nanwatch merge`) keys them by node too; '' is this
    #   database's own node, whose files are the only ones ever followed.
    # - meta uid: names this database when it is merged into another one.
    # - merge_*: which node database, event and incident every merged row came from, so merging
    #   the same database again adds nothing and node incidents' lifecycles carry over.
    """
    ALTER TABLE runs ADD COLUMN cluster_run TEXT;
    CREATE INDEX runs_job ON runs(job, cluster_run);

    ALTER TABLE sources ADD COLUMN node TEXT NOT NULL DEFAULT '';
    DROP INDEX sources_identity;
    CREATE UNIQUE INDEX sources_identity ON sources(dev, ino, gen, node);

    INSERT OR IGNORE INTO meta(key, value) VALUES ('uid', lower(hex(randomblob(16))));

    CREATE TABLE merge_origins (
        origin TEXT PRIMARY KEY,
        node TEXT,
        path TEXT NOT NULL,
        first_merged_at TEXT NOT NULL,
        last_merged_at TEXT NOT NULL,
        events INTEGER NOT NULL DEFAULT 0,
        metrics_upto INTEGER NOT NULL DEFAULT 0
    );

    CREATE TABLE merge_events (
        event_id INTEGER PRIMARY KEY,
        origin TEXT NOT NULL,
        src_id INTEGER NOT NULL,
        src_incident INTEGER
    );
    CREATE UNIQUE INDEX merge_events_src ON merge_events(origin, src_id);

    CREATE TABLE merge_incidents (
        origin TEXT NOT NULL,
        src_id INTEGER NOT NULL,
        status TEXT NOT NULL,
        resolved_at TEXT,
        PRIMARY KEY (origin, src_id)
    );
    """,
    # 3: a run's communication timeouts and errors on one backend group into one incident:
    # their grouping key is comm:<backend> (it was <kind>:<backend>).
    """
    UPDATE incidents SET key = 'comm:' || substr(key, instr(key, ':') + 1)
    WHERE kind IN ('comm_timeout', 'comm_error') AND key LIKE 'comm%:%';
    """,
    # 4: people acknowledge and resolve incidents (`nanwatch ack`, `nanwatch resolve`): who,
    # when and why, kept with the incident so `show`, --json and the Slack parent tell it.
    # resolved_by stays NULL when nanwatch resolved it itself (the reason is in detail).
    """
    ALTER TABLE incidents ADD COLUMN acked_by TEXT;
    ALTER TABLE incidents ADD COLUMN acked_at TEXT;
    ALTER TABLE incidents ADD COLUMN ack_note TEXT;
    ALTER TABLE incidents ADD COLUMN resolved_by TEXT;
    ALTER TABLE incidents ADD COLUMN resolve_note TEXT;
    """,
    # 5: per-iteration metrics as columnar blocks, one row per (source, chunk) with its
    # iterations packed (nanwatch/store/metric_codec.py); existing rows are converted, and
    # step_stats keeps the slowdown check's rolling statistics per (run, rank).
    rows_to_blocks,
    # 6: full-text search over event messages (`nanwatch events --grep`): an FTS5 index whose
    # content is the events table itself (the text is not stored twice), kept in step by
    # triggers, in the shape sqlite-utils' enable_fts(["message"], create_triggers=True)
    # gives, so its table.search() and Datasette find it. Plain SQL rather than enable_fts:
    # that one runs executescript, which commits, and a migration is one transaction.
    # Existing events are indexed here. The update trigger fires only when a message changes:
    # correlation updates every event's incident_id, which must not rewrite the index.
    """
    CREATE VIRTUAL TABLE [events_fts] USING FTS5 ([message], content=[events]);
    INSERT INTO [events_fts] (rowid, [message]) SELECT id, message FROM events;
    CREATE TRIGGER [events_ai] AFTER INSERT ON [events] BEGIN
      INSERT INTO [events_fts] (rowid, [message]) VALUES (new.id, new.message);
    END;
    CREATE TRIGGER [events_ad] AFTER DELETE ON [events] BEGIN
      INSERT INTO [events_fts] ([events_fts], rowid, [message])
      VALUES ('delete', old.id, old.message);
    END;
    CREATE TRIGGER [events_au] AFTER UPDATE OF message ON [events] BEGIN
      INSERT INTO [events_fts] ([events_fts], rowid, [message])
      VALUES ('delete', old.id, old.message);
      INSERT INTO [events_fts] (rowid, [message]) VALUES (new.id, new.message);
    END;
    """,
]
