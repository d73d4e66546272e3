"""`nanwatch merge`: node databases into one fleet database, correlated across nodes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from nanwatch.store import SCHEMA_VERSION, Store
from nanwatch.store.schema import MIGRATIONS

from ..cluster_logs import RUN, RUN_ID, write_fleet, write_nodes
from ..conftest import nanwatch


@pytest.fixture
def node_dbs(tmp_path: Path) -> dict[str, Path]:
    """Each node scanned its own logs, as its daemon would have."""
    out = {}
    for name, logs in write_nodes(tmp_path / "logs").items():
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(f'[cluster]\nnode = "{name}"\n')
        out[name] = tmp_path / f"{name}.db"
        nanwatch("scan", "--config", str(cfg), "--db", str(out[name]), str(logs))
    return out


def merge(fleet: Path, *dbs: Path) -> dict[str, Any]:
    result = nanwatch("merge", "--json", str(fleet), *map(str, dbs))
    return dict(json.loads(result.stdout))


def counts(db: Path) -> tuple[int, ...]:
    with sqlite3.connect(db) as conn:
        # metrics: iterations, packed in blocks
        return tuple(
            conn.execute(sql).fetchone()[0]
            for sql in (
                "SELECT count(*) FROM runs",
                "SELECT count(*) FROM sources",
                "SELECT count(*) FROM events",
                "SELECT coalesce(sum(n), 0) FROM metric_blocks",
                "SELECT count(*) FROM incidents",
            )
        )


def test_the_oom_on_node_a_absorbs_node_b_timeouts(
    node_dbs: dict[str, Path], tmp_path: Path
) -> None:
    # on its own, node B only knows its ranks waited for rank 3
    listed = nanwatch("incidents", "--json", "--db", str(node_dbs["node-b"])).stdout
    (orphan,) = [json.loads(line) for line in listed.splitlines()]
    assert orphan["kind"] == "comm_timeout" and orphan["detail"]["cause_rank"] == 3
    fleet = tmp_path / "fleet.db"
    out = merge(fleet, node_dbs["node-a"], node_dbs["node-b"])
    assert [m["nodes"] for m in out["merged"]] == [["node-a"], ["node-b"]]
    (inc,) = out["incidents"]
    assert inc["kind"] == "oom" and inc["status"] == "open"
    assert inc["origin"]["rank"] == 3 and inc["origin"]["stage"] == "val"
    assert inc["ranks"] == list(range(16))
    assert inc["nodes"] == ["node-a", "node-b"]
    assert (inc["job"], inc["cluster_run"]) == (RUN_ID, RUN)
    assert "15 other ranks on 2 nodes then timed out" in inc["title"]
    # `show` across the fleet: every rank's event with its node
    story = json.loads(nanwatch("show", "1", "--json", "--db", str(fleet)).stdout)
    nodes = {t["rank"]: t["node"] for t in story["timeline"]}
    assert {r for r, n in nodes.items() if n == "node-b"} == set(range(8, 16))
    assert all(e["node"] for e in story["events"])
    listed = nanwatch("runs", "--json", "--db", str(fleet)).stdout
    (run,) = [json.loads(line) for line in listed.splitlines()]
    assert run["node"] is None and run["job"] == RUN_ID  # fed by two nodes
    assert run["nodes"] == ["node-a", "node-b"]
    assert run["facts"]["launch"]["torchelastic_run_id"] == RUN_ID


OOM_RANK = 130  # on node-16 of 32


@pytest.fixture(scope="module")
def fleet_dbs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """32 nodes of 8 ranks, each scanned into its own database (node-00 first)."""
    from nanwatch.config import ClusterConfig, Config
    from nanwatch.daemon.pipeline import Pipeline

    base = tmp_path_factory.mktemp("fleet")
    dbs = []
    for name, logs in write_fleet(base / "logs", nodes=32, per_node=8, oom_rank=OOM_RANK).items():
        dbs.append(base / f"{name}.db")
        store = Store.open(dbs[-1])
        try:
            Pipeline(Config(cluster=ClusterConfig(node=name)), store, [str(logs)]).scan()
        finally:
            store.close()
    return dbs


@pytest.mark.parametrize("order", ["root-last", "root-first", "root-between"])
def test_a_32_node_fleet_names_the_rank_that_ran_out_of_memory(
    fleet_dbs: list[Path], tmp_path: Path, order: str
) -> None:
    """255 ranks' timeouts name rank 130; whichever order the node databases are merged in,
    the fleet incident's origin, title and story are that rank's."""
    root_db = fleet_dbs[OOM_RANK // 8]
    others = [d for d in fleet_dbs if d != root_db]
    dbs = {
        "root-last": [*others, root_db],
        "root-first": [root_db, *others[::-1]],
        "root-between": [*others[:16][::-1], root_db, *others[16:]],
    }[order]
    (inc,) = merge(tmp_path / "fleet.db", *dbs)["incidents"]
    assert inc["kind"] == "oom" and inc["event_count"] == 256
    assert inc["origin"]["rank"] == OOM_RANK and inc["origin"]["stage"] == "val"
    assert inc["title"].startswith(f"Out of memory on rank {OOM_RANK} in validation")
    assert "255 other ranks on 32 nodes then timed out in HCCL" in inc["title"]
    assert inc["detail"]["root_cause"].startswith(f"Rank {OOM_RANK} ran out of device memory")
    assert sorted(inc["detail"]["symptom_ranks"]) == [r for r in range(256) if r != OOM_RANK]


def test_a_fleet_incident_fits_slack_whatever_the_fleet_size(
    fleet_dbs: list[Path], tmp_path: Path
) -> None:
    """256 ranks on 32 nodes: the parent stays within 800 visible characters and every text
    block within Slack's limits (3,000 per section, 40,000 per message)."""
    from nanwatch.notify.slack_text import details_text, headline, parent_blocks, visible_chars

    merge(tmp_path / "fleet.db", *fleet_dbs)
    story = json.loads(nanwatch("show", "1", "--json", "--db", str(tmp_path / "fleet.db")).stdout)
    blocks = parent_blocks(story, first_line="E39999: " + "x" * 5000)
    assert visible_chars(blocks) <= 800
    assert len(json.dumps(blocks)) < 40_000
    details = details_text(story, first_line="E39999: " + "x" * 5000)
    assert len(details) <= 3000 and len(headline(story)) <= 3000
    assert "255 other ranks on 32 nodes" in headline(story)


def test_merging_again_adds_nothing(node_dbs: dict[str, Path], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.db"
    merge(fleet, node_dbs["node-a"], node_dbs["node-b"])
    before = counts(fleet)
    again = merge(fleet, node_dbs["node-b"], node_dbs["node-a"], node_dbs["node-a"])
    assert [m["events"] for m in again["merged"]] == [0, 0, 0]
    assert [m["metrics"] for m in again["merged"]] == [0, 0, 0]
    assert counts(fleet) == before
    assert before[0] == 1 and before[2] == 16  # one run, every event once


def test_a_root_merged_later_absorbs_the_orphan(node_dbs: dict[str, Path], tmp_path: Path) -> None:
    """Node B first (an orphan timeout incident in the fleet), node A in a later merge: the
    OOM takes the timeouts over and the orphan becomes `merged`, as on a single node."""
    fleet = tmp_path / "fleet.db"
    (first,) = merge(fleet, node_dbs["node-b"])["incidents"]
    assert first["kind"] == "comm_timeout" and first["detail"]["cause_rank"] == 3
    (root,) = merge(fleet, node_dbs["node-a"])["incidents"]
    assert root["kind"] == "oom" and root["ranks"] == list(range(16))
    with sqlite3.connect(fleet) as conn:
        status, into = conn.execute(
            "SELECT status, json_extract(detail, '$.merged_into') FROM incidents WHERE id = ?",
            (first["id"],),
        ).fetchone()
    assert (status, into) == ("merged", root["id"])


def test_node_lifecycles_carry_over(node_dbs: dict[str, Path], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.db"

    def resolve(db: Path) -> None:
        with sqlite3.connect(db) as conn:
            conn.execute(
                "UPDATE incidents SET status = 'resolved', resolved_at = '2026-11-30T12:00:00.000Z'"
            )

    merge(fleet, node_dbs["node-a"], node_dbs["node-b"])
    resolve(node_dbs["node-a"])
    (inc,) = merge(fleet, node_dbs["node-a"], node_dbs["node-b"])["incidents"]
    assert inc["status"] == "open"  # node B's part is still open
    resolve(node_dbs["node-b"])
    out = merge(fleet, node_dbs["node-b"])
    (inc,) = out["incidents"]
    assert out["resolved"] == [inc["id"]]
    assert inc["status"] == "resolved" and inc["resolved_at"] == "2026-11-30T12:00:00.000Z"


def test_runs_without_a_cluster_identity_stay_per_node(tmp_path: Path) -> None:
    """Plain logs that name no launch: two nodes' `train` runs are not one run."""
    dbs = []
    for node in ("n1", "n2"):
        logs = tmp_path / node / "train.log"
        logs.parent.mkdir()
        logs.write_text("[rank0]: RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB\n")
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(f'[cluster]\nnode = "{node}"\n')
        dbs.append(tmp_path / f"{node}.db")
        nanwatch("scan", "--config", str(cfg), "--db", str(dbs[-1]), str(logs))
    fleet = tmp_path / "fleet.db"
    out = merge(fleet, *dbs)
    assert sorted(i["run"] for i in out["incidents"]) == ["train@n1", "train@n2"]
    assert all(i["job"] is None for i in out["incidents"])


def test_bad_inputs_are_refused_with_a_reason(node_dbs: dict[str, Path], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.db"
    merge(fleet, node_dbs["node-a"])
    same = nanwatch("merge", str(fleet), str(fleet), check=False)
    assert same.returncode == 1 and "output database itself" in same.stderr
    missing = nanwatch("merge", str(fleet), str(tmp_path / "nope.db"), check=False)
    assert missing.returncode != 0 and "nope.db" in missing.stderr
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    bad = nanwatch("merge", str(fleet), str(junk), check=False)
    assert bad.returncode == 1 and "junk.db" in bad.stderr


def test_schema_3_regroups_open_communication_incidents(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(MIGRATIONS[0] + ";" + MIGRATIONS[1] + ";PRAGMA user_version=2;")
    conn.execute("INSERT INTO runs(name, root, created_at) VALUES ('job', 'job', 'now')")
    for kind, key in (("comm_timeout", "comm_timeout:nccl"), ("nan", "nan")):
        conn.execute(
            "INSERT INTO incidents(run_id, kind, key, title, created_at, updated_at) "
            "VALUES (1, ?, ?, 'old', 'now', 'now')",
            (kind, key),
        )
    conn.commit()
    conn.close()
    Store.open(db).close()
    with sqlite3.connect(db) as conn:
        keys = [r[0] for r in conn.execute("SELECT key FROM incidents ORDER BY id")]
    assert keys == ["comm:nccl", "nan"]


def test_a_schema_1_database_is_migrated_and_keeps_its_offsets(tmp_path: Path) -> None:
    """A node database written before many-node support: its files are not read again."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank0.log").write_text("[rank0]: RuntimeError: NPU out of memory.\n")
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(MIGRATIONS[0] + ";PRAGMA user_version=1;")
    conn.close()
    nanwatch("scan", "--db", str(db), str(logs))  # migrates on open, then reads
    nanwatch("scan", "--db", str(db), str(logs))
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
        assert conn.execute("SELECT node FROM sources").fetchone()[0] == ""
    store = Store.open(db, readonly=True)
    try:
        assert store.meta_get("uid")
    finally:
        store.close()
