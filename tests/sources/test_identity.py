"""Run identity across nodes: every node of one launch derives the same job and run."""

from __future__ import annotations

import json
import socket
import sqlite3
from pathlib import Path

from nanwatch.config import parse_config
from nanwatch.sources.identity import derive, rank_fill

from ..conftest import nanwatch

TORCHRUN = [
    "[2024-03-12 08:22:45,549] torch.distributed.launcher.api: [INFO] Starting elastic_operator "
    "with launch configs:",
    "[2024-03-12 08:22:45,549] torch.distributed.launcher.api: [INFO]   nproc_per_node   : 8",
    "[2024-03-12 08:22:45,549] torch.distributed.launcher.api: [INFO]   run_id           : 5982",
    "[2024-03-12 08:22:45,549] torch.distributed.launcher.api: [INFO]   rdzv_endpoint    : "
    "10.1.96.108:29500",
    "INFO:torch.distributed.elastic.agent.server.api:[default] Rendezvous complete for workers. "
    "Result:",
    "  restart_count=0",
    "  master_addr=node-a",
    "  master_port=55539",
]


def test_tiers_hook_before_logs_and_config_first() -> None:
    printed = {"launch": {"torchelastic_run_id": "5982", "slurm_job_id": "4261046"}}
    assert derive(facts=printed).job == "4261046"  # SLURM is the first tier
    hook = {"job": {"slurm_job_id": "777"}, **printed}
    assert derive(facts=hook).job == "777"  # the hook before what the logs printed
    assert derive(job="llm-7b", facts=hook).job == "llm-7b"
    # torchrun's static default names nothing; the master endpoint does
    both = {"launch": {"torchelastic_run_id": "none", "master_addr": "n0", "master_port": "29500"}}
    assert derive(facts=both).job == "n0:29500"
    assert derive(facts={"launch": {"rdzv_endpoint": "10.1.96.108:29500"}}).job == (
        "10.1.96.108:29500"
    )
    # single-node launches all say localhost: they stay apart per node
    local = {"launch": {"master_addr": "127.0.0.1", "master_port": "29500"}}
    assert derive(facts=local, node="n1").job == "127.0.0.1:29500@n1"


def test_run_is_the_mmengine_launch_else_the_job() -> None:
    facts = {"launch": {"slurm_job_id": "42"}}
    ident = derive(facts=facts, experiment="dino", launch="20261130_101500")
    assert (ident.job, ident.run) == ("42", "dino_20261130_101500")
    assert derive(facts=facts).run == "42"
    # the folder's name is what mmengine prints as its Exp name
    printed = {"launch": {"mmengine_exp": "dino_20261130_101500"}}
    assert derive(facts=printed).run == "dino_20261130_101500"
    assert derive(facts=facts, run="manual").run == "manual"
    # nothing cluster-wide: the local name, flagged as such
    local = derive(local_name="train")
    assert (local.job, local.run, local.source) == ("train", "train", "local")
    assert derive(run="r1").job == "r1"


def test_node_defaults_to_the_host_name() -> None:
    assert derive().node == socket.gethostname()
    assert derive(node="node-a").node == "node-a"


def test_rank_fill_follows_torchrun_layout() -> None:
    launch = {"nproc_per_node": "8", "group_rank": "1"}
    assert rank_fill(11, None, launch) == (11, 3)
    # an elastic failure line names only the local rank: the engine let it stand in
    assert rank_fill(3, 3, launch) == (11, 3)
    assert rank_fill(None, 5, launch) == (13, 5)
    assert rank_fill(3, 3, {"nproc_per_node": "8", "group_rank": "0"}) == (3, 3)
    assert rank_fill(3, None, {}) == (3, None)  # nothing printed: nothing guessed


def _node_logs(base: Path, node: str, ranks: range, header: list[str]) -> Path:
    """One node's view of a launch: its ranks' mmengine logs and the torchrun agent's output."""
    launch = base / node / "work_dirs" / "dino" / "20261130_101500"
    launch.mkdir(parents=True)
    (launch / "torchrun.log").write_text("\n".join(header) + "\n")
    for r in ranks:
        (launch / f"rank{r}.log").write_text(
            f"2026/11/30 10:15:00 - mmengine - INFO - Epoch(train)  [1][10/100]  lr: 1.0e-04  "
            f"eta: 1:00:00  time: 0.8600  data_time: 0.0123  memory: 21034  loss: 0.5\n"
            f"[rank{r}]: RuntimeError: NCCL communicator was aborted on rank {r}.\n"
        )
    return launch.parent


def test_two_nodes_agree_on_job_and_run(tmp_path: Path) -> None:
    """Each node scans only its own logs, yet both name the launch alike; events carry their
    node and both ranks (the second node's local ranks from torchrun's group_rank)."""
    rows = []
    for node, ranks, group in (("node-a", range(0, 8), "0"), ("node-b", range(8, 16), "1")):
        header = [*TORCHRUN, f"  group_rank={group}"]
        logs = _node_logs(tmp_path, node, ranks, header)
        cfg = tmp_path / f"{node}.toml"
        cfg.write_text(f'[cluster]\nnode = "{node}"\n')
        db = tmp_path / f"{node}.db"
        nanwatch("scan", "--config", str(cfg), "--db", str(db), str(logs))
        with sqlite3.connect(db) as conn:
            rows.append(conn.execute("SELECT job, cluster_run, node, facts FROM runs").fetchone())
            events = conn.execute("SELECT rank, local_rank, node FROM events").fetchall()
        assert events and all(n == node for _, _, n in events)
        assert sorted(r for r, _, _ in events) == list(ranks)
        assert sorted(lr for _, lr, _ in events) == list(range(8))
    (job_a, run_a, _, facts_a), (job_b, run_b, _, _) = rows
    assert (job_a, run_a) == (job_b, run_b) == ("5982", "dino_20261130_101500")
    assert json.loads(facts_a)["launch"]["master_addr"] == "node-a"


def test_cluster_config_overrides(tmp_path: Path) -> None:
    cfg = parse_config({"cluster": {"job": "llm", "run": "try3", "node": "n1"}})
    assert (cfg.cluster.job, cfg.cluster.run, cfg.cluster.node) == ("llm", "try3", "n1")
    logs = _node_logs(tmp_path, "n1", range(2), TORCHRUN)
    conf = tmp_path / "n.toml"
    conf.write_text('[cluster]\njob = "llm"\nrun = "try3"\n')
    db = tmp_path / "n.db"
    nanwatch("scan", "--config", str(conf), "--db", str(db), str(logs))
    out = json.loads(nanwatch("incidents", "--json", "--db", str(db)).stdout.splitlines()[0])
    assert (out["job"], out["cluster_run"], out["node"]) == ("llm", "try3", socket.gethostname())
