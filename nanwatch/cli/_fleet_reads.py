"""`incidents`, `show`, `events`, `runs` with `--db postgresql://...`: the fleet store.

The fleet store holds the fleet incidents as the documents `nanwatch fleet` published (the
shapes `incidents --json` and `show --json` print on a node), so the same tables and story
render them. The node incidents a fleet incident absorbed are listed with it as merged
evidence, never as incidents of their own. The password comes from the config's
`[fleet] password_file`, LoadCredential=fleet-password, PGPASSWORD or ~/.pgpass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import load_config
from ..errors import NanwatchError
from ..store.fleet import FleetStore
from ..store.records import JSON

Doc = dict[str, JSON]


@contextmanager
def fleet_reader(dsn: str, config_path: Path | None) -> Iterator[FleetStore]:
    from ..notify.forward import fleet_password

    config = load_config(config_path)
    store = FleetStore.connect(dsn, password=fleet_password(config), migrate=False)
    try:
        yield store
    finally:
        store.close()


def incidents(
    dsn: str,
    config_path: Path | None,
    *,
    status: str | None,
    kind: str | None,
    run: str | None,
    rank: int | None,
    since: str | None,
    until: str | None,
    limit: int | None,
) -> list[Doc]:
    with fleet_reader(dsn, config_path) as fleet:
        docs = fleet.incidents(open_only=status == "open", kind=kind, run=run)
    out = []
    for d in docs:
        if status == "resolved" and d.get("status") != "resolved":
            continue
        if rank is not None and rank not in (d.get("ranks") or []):
            continue
        if since and str(d.get("last_time") or d.get("first_time") or "") < since:
            continue
        if until and str(d.get("first_time") or "") > until:
            continue
        out.append(d)
    return out[-limit:] if limit else out


def show(dsn: str, config_path: Path | None, incident_id: int) -> Doc:
    with fleet_reader(dsn, config_path) as fleet:
        story = fleet.story(incident_id)
        members = fleet.members(incident_id)
    if story is None:
        raise NanwatchError(
            f"no fleet incident #{incident_id}; list them with `nanwatch incidents --db DSN`"
        )
    story["node_incidents"] = [{"node": n, "id": i, "status": "merged"} for n, i in members]
    return story


def events(
    dsn: str,
    config_path: Path | None,
    *,
    kind: str | None,
    rank: int | None,
    grep: str | None,
    limit: int | None,
) -> list[Doc]:
    with fleet_reader(dsn, config_path) as fleet:
        rows = fleet.events(kind=kind)
    if rank is not None:
        rows = [r for r in rows if r.get("rank") == rank]
    if grep:
        words = grep.lower().rstrip("*").split()
        rows = [r for r in rows if all(w in str(r.get("message") or "").lower() for w in words)]
    return rows[-limit:] if limit else rows


def runs(dsn: str, config_path: Path | None) -> list[Doc]:
    with fleet_reader(dsn, config_path) as fleet:
        return fleet.runs()
