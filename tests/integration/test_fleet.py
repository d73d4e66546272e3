"""Fleet mode on a real PostgreSQL (Debian's server, started here on loopback).

8 nodes x 8 ranks of one launch: rank 13 (node-01) runs out of NPU memory in validation, every
other rank's HCCL collective times out naming it. Each node scans its own logs into its own
SQLite and forwards; `nanwatch fleet` correlates them as one launch.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..cluster_logs import write_fleet
from ..conftest import NANWATCH, nanwatch, wait_for
from ..pg_server import PASSWORD, PgServer, bindir

psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.skipif(bindir() is None, reason="PostgreSQL is not installed")

NODES, PER_NODE, OOM_RANK = 8, 8, 13


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    server = PgServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def dsn(pg: PgServer, request: pytest.FixtureRequest) -> str:
    name = "t_" + "".join(c if c.isalnum() else "_" for c in request.node.name)[:50].lower()
    return pg.create_database(name)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fleet-logs")
    return write_fleet(base, nodes=NODES, per_node=PER_NODE, oom_rank=OOM_RANK)


@pytest.fixture(scope="module")
def node_dbs(logs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each node's logs scanned once into its own database (copied by the tests that forward)."""
    from nanwatch.config import ClusterConfig, Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.store import Store

    base = tmp_path_factory.mktemp("node-dbs")
    out = {}
    for node, path in logs.items():
        out[node] = base / f"{node}.db"
        store = Store.open(out[node])
        try:
            Pipeline(Config(cluster=ClusterConfig(node=node)), store, [str(path)]).scan()
        finally:
            store.close()
    return out


def forward_copy(node_dbs: dict[str, Path], node: str, tmp: Path, dsn: str, *, now: float) -> None:
    """A copy of ``node``'s database forwarded once, as its daemon would."""
    from nanwatch.config import load_config
    from nanwatch.notify.forward import Forwarder
    from nanwatch.store import Store

    db = tmp / f"{node}.db"
    shutil.copy(node_dbs[node], db)
    store = Store.open(db)
    try:
        fwd = Forwarder(load_config(node_config(tmp, node, dsn)), node=node)
        report = fwd.forward(store, now=now)
        fwd.close()
    finally:
        store.close()
    assert report.error is None and report.waiting == 0


def _password_file(tmp: Path) -> Path:
    p = tmp / "fleet-password"
    p.write_text(PASSWORD + "\n")
    p.chmod(0o600)
    return p


def node_config(tmp: Path, node: str, dsn: str) -> Path:
    cfg = tmp / f"{node}.toml"
    cfg.write_text(
        f'db = "{tmp / (node + ".db")}"\n'
        f'[cluster]\nnode = "{node}"\n'
        f'[fleet]\ndsn = "{dsn}"\npassword_file = "{_password_file(tmp)}"\n'
    )
    return cfg


def fleet_config(tmp: Path, dsn: str, extra: str = "") -> Path:
    cfg = tmp / "fleet.toml"
    cfg.write_text(
        f'db = "{tmp / "central.db"}"\n'
        f'[fleet]\ndsn = "{dsn}"\npassword_file = "{_password_file(tmp)}"\n'
        f'state_db = "{tmp / "fleet-state.db"}"\n' + extra
    )
    return cfg


def scan(cfg: Path, path: Path, **kw: Any) -> dict[str, Any]:
    return dict(
        json.loads(nanwatch("scan", "--json", "--config", str(cfg), str(path), **kw).stdout)
    )


def pg_count(dsn: str, sql: str) -> int:
    with psycopg.connect(dsn, password=PASSWORD) as conn:
        row = conn.execute(sql).fetchone()
        return int(row[0])


def local_count(db: Path) -> int:
    """Events in a node database; 0 while it is still being created."""
    try:
        with sqlite3.connect(db) as conn:
            return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])
    except sqlite3.OperationalError:
        return 0


def test_eight_nodes_forward_and_the_fleet_names_the_oom_rank(
    logs: dict[str, Path], dsn: str, tmp_path: Path
) -> None:
    total = 0
    for node, path in logs.items():
        summary = scan(node_config(tmp_path, node, dsn), path)
        assert summary["fleet"]["error"] is None
        assert summary["fleet"]["waiting"] == 0
        assert summary["fleet"]["forwarded"] == local_count(tmp_path / f"{node}.db")
        total += summary["fleet"]["forwarded"]
    assert pg_count(dsn, "SELECT count(*) FROM events") == total
    assert pg_count(dsn, "SELECT count(DISTINCT node) FROM events") == NODES

    out = json.loads(
        nanwatch("fleet", "--once", "--json", "--config", str(fleet_config(tmp_path, dsn))).stdout
    )
    # --json is an interface: these keys stay (more may come)
    assert {"waited_for_lock", "cycles", "pulled", "nodes", "silent_nodes", "incidents"} <= set(out)
    (inc,) = out["incidents"]
    assert inc["kind"] == "oom" and inc["origin"]["rank"] == OOM_RANK
    assert inc["origin"]["stage"] == "val"
    assert (
        f"{NODES * PER_NODE - 1} other ranks on {NODES} nodes then timed out in HCCL"
        in inc["title"]
    )
    assert out["nodes"] == NODES
    # every node's own incident is evidence of the fleet incident, not an incident of its own
    members = pg_count(
        dsn, f"SELECT count(DISTINCT node) FROM fleet_members WHERE fleet_incident = {inc['id']}"
    )
    assert members == NODES

    # the read commands answer on the fleet store like on a node's file
    env = {"PGPASSWORD": PASSWORD}
    listed = [
        json.loads(x)
        for x in nanwatch("incidents", "--db", dsn, "--json", env=env).stdout.splitlines()
    ]
    assert [i["id"] for i in listed] == [inc["id"]] and listed[0]["title"] == inc["title"]
    story = nanwatch("show", str(inc["id"]), "--db", dsn, env=env).stdout
    assert f"Out of memory on rank {OOM_RANK}" in story
    assert f"Node incidents merged into it ({NODES})" in story
    shown = json.loads(nanwatch("show", str(inc["id"]), "--db", dsn, "--json", env=env).stdout)
    assert {m["node"] for m in shown["node_incidents"]} == set(logs)
    assert set(shown["hosts"]) == set(logs)  # every node of the story, with its host
    (oom,) = [
        json.loads(x)
        for x in nanwatch(
            "events", "--db", dsn, "--kind", "oom", "--json", env=env
        ).stdout.splitlines()
    ]
    assert (oom["rank"], oom["local_rank"], oom["node"]) == (
        OOM_RANK,
        OOM_RANK % PER_NODE,
        "node-01",
    )
    assert oom["host"]  # the machine node-01's daemon forwarded from
    runs = [
        json.loads(x) for x in nanwatch("runs", "--db", dsn, "--json", env=env).stdout.splitlines()
    ]
    assert sorted(r["node"] for r in runs) == sorted(logs)
    # a password on the command line is refused, and never echoed
    with_pw = dsn.replace("nanwatch@", f"nanwatch:{PASSWORD}@")
    bad = nanwatch("incidents", "--db", with_pw, check=False)
    assert bad.returncode != 0 and "PGPASSWORD" in bad.stderr and PASSWORD not in bad.stderr

    # a second cycle pulls nothing and changes nothing
    again = json.loads(
        nanwatch("fleet", "--once", "--json", "--config", str(fleet_config(tmp_path, dsn))).stdout
    )
    assert again["pulled"] == 0
    assert [i["id"] for i in again["incidents"]] == [inc["id"]]


def test_a_fleet_store_that_is_down_loses_nothing_and_doubles_nothing(
    logs: dict[str, Path], pg: PgServer, dsn: str, tmp_path: Path
) -> None:
    from nanwatch.config import load_config
    from nanwatch.notify.forward import Forwarder
    from nanwatch.store import Store

    node = "node-03"
    cfg = node_config(tmp_path, node, dsn)
    db = tmp_path / f"{node}.db"
    pg.stop()
    try:
        proc = nanwatch("scan", "--json", "--config", str(cfg), str(logs[node]))
    finally:
        pg.restart()
    summary = json.loads(proc.stdout)
    local = local_count(db)
    assert proc.returncode == 0 and local > 0
    assert summary["fleet"]["waiting"] == local and summary["fleet"]["forwarded"] == 0
    assert "wait to be forwarded" in proc.stderr and PASSWORD not in proc.stderr

    # back up: half of it in small batches, the store goes down again, then the rest
    config = load_config(cfg)
    store = Store.open(db)
    try:
        fwd = Forwarder(config, node=node)
        fwd.forward(store, now=1000.0)  # reconnects, sends everything waiting
        assert pg_count(dsn, "SELECT count(*) FROM events") == local
        # the node dies after the fleet committed and before its own cursor moved: resent
        with store.transaction():
            store.meta_set("fleet.forwarded_upto", "0")
        again = fwd.forward(store, now=1001.0)
        assert again.sent == local and again.events == 0
        fwd.close()
    finally:
        store.close()
    assert pg_count(dsn, "SELECT count(*) FROM events") == local
    assert (
        pg_count(
            dsn,
            'SELECT count(*) FROM (SELECT node, source_key, "offset", key FROM events '
            "GROUP BY 1, 2, 3, 4 HAVING count(*) > 1) d",
        )
        == 0
    )


def test_two_correlators_one_works_the_other_waits(
    node_dbs: dict[str, Path], dsn: str, tmp_path: Path
) -> None:
    for node in ("node-00", "node-01"):
        forward_copy(node_dbs, node, tmp_path, dsn, now=1000.0)
    cfg = fleet_config(tmp_path, dsn)
    second: subprocess.Popen[str] | None = None
    first = subprocess.Popen(
        [*NANWATCH, "fleet", "--config", str(cfg), "--interval", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: _published(dsn) > 0, timeout=60, what="the first correlator publishes")
        second = subprocess.Popen(
            [*NANWATCH, "fleet", "--once", "--json", "--config", str(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = second.stderr.readline() if second.stderr else ""
        assert "another instance holds the lock" in line
        assert second.poll() is None  # it waits while the first works
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 0
        doc = json.loads(out)
        assert doc["waited_for_lock"] is True
        assert [i["kind"] for i in doc["incidents"]] == ["oom"]
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()


def _published(dsn: str) -> int:
    try:
        return pg_count(dsn, "SELECT count(*) FROM fleet_incidents")
    except psycopg.Error:
        return 0


def test_a_node_that_goes_silent_is_named_as_the_suspect(
    node_dbs: dict[str, Path], dsn: str, tmp_path: Path
) -> None:
    """node-01 holds the OOM rank but never forwards past its first heartbeat: the others'
    timeouts stay a symptom incident, and node-01 is named as silent on it."""
    from nanwatch.cli.fleet import _publish
    from nanwatch.config import load_config
    from nanwatch.correlate import Correlator
    from nanwatch.correlate.fleet import FleetCorrelator
    from nanwatch.notify.forward import Forwarder
    from nanwatch.store import Store
    from nanwatch.store.fleet import FleetStore

    t0 = 1_800_000_000.0
    for node in node_dbs:
        if node == "node-01":
            # its daemon started (a heartbeat, nothing read) and then went silent
            db = tmp_path / f"{node}.db"
            Store.open(db).close()
            store = Store.open(db)
            try:
                fwd = Forwarder(load_config(node_config(tmp_path, node, dsn)), node=node)
                fwd.forward(store, now=t0)
                fwd.close()
            finally:
                store.close()
        else:
            forward_copy(node_dbs, node, tmp_path, dsn, now=t0 + 600)
    fleet = FleetStore.connect(dsn, password=PASSWORD)
    work = Store.open(tmp_path / "work.db")
    try:
        cycle = FleetCorrelator(fleet, work, Correlator(work)).cycle(now=t0 + 601)
        assert [s.node for s in cycle.silent] == ["node-01"]
        silent = {s.node: s for s in cycle.silent}
        _publish(fleet, work, cycle.touched, silent, now=t0 + 601)
        (doc,) = fleet.incidents()
    finally:
        work.close()
        fleet.close()
    assert doc["kind"] == "comm_timeout"
    assert [s["node"] for s in doc["silent_nodes"]] == ["node-01"]
    assert doc["silent_nodes"][0]["silent_for"] == 601.0


def test_a_password_in_the_dsn_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[fleet]\ndsn = "postgresql://nanwatch:hunter2@db:5432/nanwatch"\n')
    proc = nanwatch("scan", "--config", str(cfg), str(tmp_path), check=False)
    assert proc.returncode != 0
    assert "password_file" in proc.stderr and "hunter2" not in proc.stderr


def test_no_dsn_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    proc = nanwatch("fleet", "--once", "--config", str(cfg), check=False)
    assert proc.returncode == 78 and "[fleet] dsn" in proc.stderr


def test_watch_forwards_live_through_a_fleet_store_outage(
    logs: dict[str, Path], pg: PgServer, dsn: str, tmp_path: Path
) -> None:
    """`watch` forwards after its passes; the fleet store goes down while the node keeps
    reading; what was committed meanwhile arrives after the restart, each event once."""
    import datetime as dt

    from nanwatch.demo.simulate import mmengine_iter_line

    node = "node-05"
    here = tmp_path / "logs"
    shutil.copytree(logs[node], here)
    cfg = node_config(tmp_path, node, dsn)
    cfg.write_text(cfg.read_text() + 'heartbeat = "1s"\n')
    db = tmp_path / f"{node}.db"
    proc = subprocess.Popen(
        [*NANWATCH, "watch", "--quiet", "--config", str(cfg), str(here)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: db.exists() and local_count(db) > 0, timeout=60, what="events read")
        wait_for(
            lambda: _pg_events(dsn) == local_count(db), timeout=60, what="everything forwarded"
        )
        before = local_count(db)
        pg.stop()
        try:
            rank_log = next(here.rglob("rank40.log"))
            line = mmengine_iter_line(
                dt.datetime(2026, 11, 30, 12, 0, 0), "train", 3, 5, 20, step_time=0.41,
                losses={"loss": float("nan")},
            )  # fmt: skip
            with rank_log.open("a") as f:
                f.write(line + "\n")
            wait_for(lambda: local_count(db) > before, timeout=60, what="the NaN committed")
        finally:
            pg.restart()
        wait_for(
            lambda: _pg_events(dsn) == local_count(db), timeout=60, what="the backlog forwarded"
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "wait to be forwarded" in err and PASSWORD not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert pg_count(dsn, "SELECT count(*) FROM events WHERE kind = 'nan'") == 1
    assert _pg_events(dsn) == local_count(db)


def _pg_events(dsn: str) -> int:
    try:
        return pg_count(dsn, "SELECT count(*) FROM events")
    except psycopg.Error:
        return -1


def test_the_fleet_notifies_once_with_the_root_and_holds_its_symptoms(
    node_dbs: dict[str, Path], dsn: str, tmp_path: Path
) -> None:
    """Seven nodes' timeouts arrive first; the OOM's node forwards an hour late (a backlog).
    Within [fleet] hold nothing about the timeouts goes out; once the root is in, Alertmanager
    gets one alert, the OOM's, naming the root, and never one for the absorbed timeouts."""
    from ..am_server import Catcher

    with Catcher() as am:
        cfg = fleet_config(tmp_path, dsn, f'[alertmanager]\nurls = ["{am.url}"]\n')
        cfg.write_text(cfg.read_text().replace("[fleet]\n", '[fleet]\nhold = "1h"\n'))
        for node in node_dbs:
            if node != "node-01":
                forward_copy(node_dbs, node, tmp_path, dsn, now=1000.0)
        first = json.loads(nanwatch("fleet", "--once", "--json", "--config", str(cfg)).stdout)
        assert [i["kind"] for i in first["incidents"]] == ["comm_timeout"]
        assert am.alerts() == []  # held: its root may still arrive
        forward_copy(node_dbs, "node-01", tmp_path, dsn, now=1000.0)
        second = json.loads(nanwatch("fleet", "--once", "--json", "--config", str(cfg)).stdout)
        assert [i["kind"] for i in second["incidents"]] == ["oom"]
        alerts = am.alerts()
        assert {a["labels"]["kind"] for a in alerts} == {"oom"}
        assert {a["labels"]["rank"] for a in alerts} == {str(OOM_RANK)}
        # run again: nothing new to tell (re-sends are Alertmanager's repeat, not ours)
        nanwatch("fleet", "--once", "--config", str(cfg))
        assert {a["labels"]["kind"] for a in am.alerts()} == {"oom"}


def test_the_first_nan_is_the_first_across_every_node(dsn: str, tmp_path: Path) -> None:
    """Rank 45 (node-05) logs a NaN first; one logged iteration later every rank of every node
    does. Each node alone would name its own first rank; the fleet names rank 45, once."""
    from nanwatch.config import ClusterConfig, Config
    from nanwatch.daemon.pipeline import Pipeline
    from nanwatch.demo.simulate import TrainingRun
    from nanwatch.store import Store

    from ..cluster_logs import EXPERIMENT, STAMP, torchrun_log

    run = TrainingRun(
        tmp_path / "staging" / EXPERIMENT, timestamp=STAMP, ranks=NODES * PER_NODE, epochs=2,
        iters=20, log_interval=5, nan_rank=45, nan_at=(1, 10), seed=5,
    )  # fmt: skip
    run.write()
    dbs = {}
    for n in range(NODES):
        node = f"node-{n:02d}"
        launch = tmp_path / node / "work_dirs" / EXPERIMENT / STAMP
        launch.mkdir(parents=True)
        (launch / "torchrun.log").write_text(torchrun_log(n, NODES, PER_NODE))
        for r in range(n * PER_NODE, (n + 1) * PER_NODE):
            shutil.copy(run.rank_path(r), launch / f"rank{r}.log")
        dbs[node] = tmp_path / f"{node}-scanned.db"
        store = Store.open(dbs[node])
        try:
            Pipeline(Config(cluster=ClusterConfig(node=node)), store, [str(launch.parent)]).scan()
        finally:
            store.close()
    for node in dbs:
        forward_copy(dbs, node, tmp_path, dsn, now=1000.0)
    out = json.loads(
        nanwatch("fleet", "--once", "--json", "--config", str(fleet_config(tmp_path, dsn))).stdout
    )
    (inc,) = [i for i in out["incidents"] if i["kind"] == "nan"]
    assert inc["origin"]["rank"] == 45
    assert sorted(inc["ranks"]) == list(range(NODES * PER_NODE))
    assert len(inc["title"]) < 300
