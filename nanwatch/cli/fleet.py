"""`nanwatch fleet`: the central correlator over the fleet store (PostgreSQL)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ._common import EXIT_UNFIXABLE, config_option, emit_json, handle_errors, json_option

if TYPE_CHECKING:
    from ..config import Config
    from ..correlate.fleet import SilentNode
    from ..notify.outbox import Sink
    from ..store import Store
    from ..store.fleet import FleetStore
    from ..store.records import JSON

# incidents whose cause may still arrive from another node: held for [fleet] hold before the
# first notification, so a late root absorbs them instead of following them
SYMPTOM_KINDS = frozenset({"comm_timeout", "comm_error", "process_failure"})


class _Held:
    """A sink whose first message of an incident waits ``hold`` seconds (see SYMPTOM_KINDS:
    the outbox row of a symptom that a root absorbs in the meantime is then never sent)."""

    def __init__(self, sink: Sink, hold: float) -> None:
        self._sink = sink
        self._hold = hold

    def __getattr__(self, name: str) -> Any:  # the wrapped sink's attributes, whatever they are
        return getattr(self._sink, name)

    def delay(self, action: str) -> float:
        base = float(self._sink.delay(action))
        return max(base, self._hold) if action == "open" else base


@click.command()
@config_option
@json_option
@click.option("--once", is_flag=True, help="Correlate what the fleet store holds, then exit.")
@click.option(
    "--interval",
    type=click.FloatRange(0.1, 3600),
    default=2.0,
    show_default=True,
    help="Seconds between cycles (service mode).",
)
@handle_errors
def fleet(config_path: Path | None, as_json: bool, once: bool, interval: float) -> None:
    """Correlate every node of the fleet store ([fleet] dsn) as one launch, and notify once.

    Nodes with `[fleet] dsn` forward what they commit; this command pulls it into its working
    database (`[fleet] state_db`), runs the same correlation as a node (an OOM on one node
    absorbs the timeouts of every other node; the first NaN is the first across all ranks; a
    node that stopped forwarding while others time out is named as a suspect) and publishes
    the fleet incidents to the fleet store, where `nanwatch incidents --db postgresql://...`
    reads them. Notifications ([slack], [alertmanager] in this config) are sent from here,
    once per fleet incident; a symptom waits `[fleet] hold` for its root.

    Two instances are safe: one holds a PostgreSQL advisory lock and works, the other waits
    for it. The password comes from `[fleet] password_file`, LoadCredential=fleet-password,
    PGPASSWORD or ~/.pgpass, never from the DSN.

    \b
    Examples:
      nanwatch fleet --config /etc/nanwatch/fleet.toml          # the service
      nanwatch fleet --config fleet.toml --once --json           # one cycle, a summary
    """
    from ..config import load_config
    from ..correlate import Correlator
    from ..correlate.chains import Timeouts
    from ..correlate.fleet import FleetCorrelator
    from ..correlate.knowledge import Knowledge
    from ..notify.forward import fleet_password
    from ..notify.outbox import Outbox, Sender
    from ..store import Store
    from ..store.fleet import FleetStore
    from ..store.outbox import OutboxStore
    from .ingest import _sinks

    config = load_config(config_path) if config_path else load_config(_env_config())
    if not config.fleet.dsn:
        where = config.path or "the config"
        click.echo(
            f"nanwatch: error: {where}: [fleet] dsn is not set; add\n"
            '  [fleet]\n  dsn = "postgresql://nanwatch@fleet-db:5432/nanwatch"',
            err=True,
        )
        raise SystemExit(EXIT_UNFIXABLE)
    state = Path(config.fleet.state_db) if config.fleet.state_db else _default_state(config)
    fleet_store = FleetStore.connect(config.fleet.dsn, password=fleet_password(config))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    waited = _take_lock(fleet_store, stop, interval)
    if stop.is_set():
        fleet_store.close()
        return
    work = Store.open(state)
    sinks = _sinks(config, console=False, correlator=True)
    # the first message of a symptom waits [fleet] hold for its root (see SYMPTOM_KINDS)
    held = Outbox(work, [_Held(s, config.fleet.hold) for s in sinks]) if sinks else None
    outbox = Outbox(work, sinks) if sinks else None
    sender = Sender(str(state), sinks) if sinks else None
    correlator = Correlator(
        work,
        timeouts=Timeouts(config.knowledge.hccl_exec_timeout, config.knowledge.nccl_timeout),
        knowledge=Knowledge.load(config.knowledge.dirs, cann_version=config.knowledge.cann_version),
    )
    cycles = FleetCorrelator(fleet_store, work, correlator)
    summary: dict[str, JSON] = {"waited_for_lock": waited, "cycles": 0, "pulled": 0}
    last_silent: set[str] = set()
    try:
        while True:
            now = time.time()
            cycle = cycles.cycle(now=now)
            silent = {s.node: s for s in cycle.silent}
            touched = set(cycle.touched)
            if set(silent) != last_silent or not summary["cycles"]:
                touched |= set(_open_symptoms(work))
            last_silent = set(silent)
            _publish(fleet_store, work, sorted(touched), silent, now=now)
            if outbox is not None and held is not None and sender is not None:
                symptoms = set(_open_symptoms(work))
                first = [
                    c for c in cycle.changes if c.action == "open" and c.incident_id in symptoms
                ]
                held.enqueue(first)
                outbox.enqueue([c for c in cycle.changes if c not in first])
                # a held symptom that became a root (or was absorbed by one) waits no more
                OutboxStore(work).release(
                    {c.incident_id for c in cycle.changes} - symptoms, now=time.time()
                )
                with _reader(state) as reader:
                    sender.deliver_due(reader)  # its own clock: rows queued just now are due
                outbox.record(sender.drain_results())
            summary["cycles"] += 1
            summary["pulled"] += cycle.pulled
            summary["nodes"] = cycle.nodes
            summary["silent_nodes"] = sorted(silent)
            if once or stop.wait(interval):
                break
        incidents = fleet_store.incidents()
    finally:
        fleet_store.unlock()
        fleet_store.close()
        work.close()
    summary["incidents"] = incidents
    if as_json:
        emit_json(summary)
        return
    click.echo(
        f"fleet: {summary['pulled']} event(s) pulled from {summary.get('nodes', 0)} node(s); "
        f"{len(incidents)} incident(s)"
    )
    for doc in incidents:
        click.echo(f"  #{doc['id']} [{doc['status']}] {doc['title']}")


def _env_config() -> str | None:
    import os

    return os.environ.get("NANWATCH_CONFIG") or None


def _default_state(config: Config) -> Path:
    from ..config import default_db_path

    base = Path(config.db) if config.db else default_db_path()
    return base.with_name("fleet-state.db")


def _take_lock(fleet_store: FleetStore, stop: threading.Event, interval: float) -> bool:
    """The advisory lock; while another instance holds it, wait (say so once)."""
    waited = False
    while not fleet_store.try_lock():
        if not waited:
            click.echo("fleet: another instance holds the lock; waiting for it", err=True)
        waited = True
        if stop.wait(interval):
            break
    return waited


class _reader:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Store:
        from ..store import Store

        self.store = Store.open(self.path, readonly=True)
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def _open_symptoms(work: Store) -> list[int]:
    from ..query import list_incidents

    return [
        int(d["id"]) for d in list_incidents(work, open_only=True) if d.get("kind") in SYMPTOM_KINDS
    ]


def _publish(
    fleet_store: FleetStore,
    work: Store,
    ids: Sequence[int],
    silent: Mapping[str, SilentNode],
    *,
    now: float,
) -> None:
    """The touched fleet incidents, as documents readers get from the fleet store."""
    from ..query import incident_dict, show_incident
    from ..store.fleet_work import work_members

    if not ids:
        return
    docs = []
    hosts = fleet_store.hosts()
    for iid in ids:
        doc = incident_dict(work, iid)
        full = show_incident(work, iid, max_events=200)
        if doc is None or full is None:
            continue
        if doc.get("status") == "open" and doc.get("kind") in SYMPTOM_KINDS and silent:
            doc["silent_nodes"] = [
                {"node": s.node, "host": s.host, "silent_for": s.silent_for}
                for s in silent.values()
            ]
            full["silent_nodes"] = doc["silent_nodes"]
        # where each node of the story runs: its timeline names nodes, people log in to hosts
        full["hosts"] = {
            n: hosts[n]
            for n in sorted({str(t.get("node")) for t in full.get("timeline") or []})
            if n in hosts
        }
        docs.append((doc, full))
    fleet_store.publish(docs, work_members(work, [int(d["id"]) for d, _ in docs]), now=now)
