"""Two nodes of one 16-rank launch: node A holds ranks 0-7 (rank 3 runs out of NPU memory in
validation), node B ranks 8-15 (their HCCL collectives time out naming remote rank 3).

Written by ``nanwatch.demo.simulate.TrainingRun`` (real-format mmengine lines, torch_npu's OOM
traceback, EI0002) and split the way two nodes' disks hold it, each with the torchrun agent's
own output (launch configs and rendezvous result, as torch 2.2 prints them).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from nanwatch.demo.simulate import TrainingRun

RUN_ID = "dino-4n-7741"  # torchrun --rdzv-id
EXPERIMENT = "dino"
STAMP = "20261130_101500"
RUN = f"{EXPERIMENT}_{STAMP}"  # what mmengine prints as its Exp name


def torchrun_log(group_rank: int, nodes: int = 2, per_node: int = 8) -> str:
    head = "[2026-11-30 10:14:58,101] torch.distributed.launcher.api: [INFO]"
    agent = "[2026-11-30 10:14:58,420] torch.distributed.elastic.agent.server.api: [INFO]"
    return "\n".join(
        [
            f"{head} Starting elastic_operator with launch configs:",
            f"{head}   entrypoint       : tools/train.py",
            f"{head}   min_nodes        : {nodes}",
            f"{head}   max_nodes        : {nodes}",
            f"{head}   nproc_per_node   : {per_node}",
            f"{head}   run_id           : {RUN_ID}",
            f"{head}   rdzv_backend     : c10d",
            f"{head}   rdzv_endpoint    : node-a:29400",
            f"{agent} [default] Rendezvous complete for workers. Result:",
            "  restart_count=0",
            "  master_addr=node-a",
            "  master_port=44123",
            f"  group_rank={group_rank}",
            f"  group_world_size={nodes}",
            "",
        ]
    )


def write_nodes(base: Path) -> dict[str, Path]:
    """{node name: its log folder (the work_dir to watch)}; rank files land in each node's
    ``work_dirs/dino/20261130_101500/``."""
    staging = base / "staging"
    run = TrainingRun(
        staging / EXPERIMENT,
        timestamp=STAMP,
        ranks=16,
        epochs=3,
        iters=20,
        log_interval=10,
        nan_rank=None,
        nan_at=None,
        val_after_epoch=2,
        val_iters=20,
        oom_rank=3,
        oom_val_iter=20,
        seed=3,
    )
    run.write()
    out = {}
    for node, group, ranks in (("node-a", 0, range(0, 8)), ("node-b", 1, range(8, 16))):
        launch = base / node / "work_dirs" / EXPERIMENT / STAMP
        launch.mkdir(parents=True)
        (launch / "torchrun.log").write_text(torchrun_log(group), encoding="utf-8")
        for r in ranks:
            shutil.copy(run.rank_path(r), launch / f"rank{r}.log")
        out[node] = launch.parent
    shutil.rmtree(staging)
    return out


def write_fleet(base: Path, *, nodes: int, per_node: int, oom_rank: int) -> dict[str, Path]:
    """``nodes`` nodes of ``per_node`` ranks each (node-00 holds ranks 0..per_node-1): rank
    ``oom_rank`` runs out of NPU memory in validation, every other rank's HCCL collective times
    out naming it. {node name: its log folder}, as :func:`write_nodes`."""
    staging = base / "staging"
    run = TrainingRun(
        staging / EXPERIMENT,
        timestamp=STAMP,
        ranks=nodes * per_node,
        epochs=3,
        iters=20,
        log_interval=10,
        nan_rank=None,
        nan_at=None,
        val_after_epoch=2,
        val_iters=20,
        oom_rank=oom_rank,
        oom_val_iter=20,
        seed=3,
    )
    run.write()
    out = {}
    for n in range(nodes):
        node = f"node-{n:02d}"
        launch = base / node / "work_dirs" / EXPERIMENT / STAMP
        launch.mkdir(parents=True)
        (launch / "torchrun.log").write_text(torchrun_log(n, nodes, per_node), encoding="utf-8")
        for r in range(n * per_node, (n + 1) * per_node):
            shutil.copy(run.rank_path(r), launch / f"rank{r}.log")
        out[node] = launch.parent
    shutil.rmtree(staging)
    return out
