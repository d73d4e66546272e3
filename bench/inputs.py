"""Realistic inputs, generated on the spot (seeded, so every run reads the same bytes).

- ``mmengine_logs``: two launches of a DINO-like 8-rank mmengine training (one rank log each),
  the first ending in the seed case's NPU out-of-memory on rank 3 in validation with HCCL
  EI0002 timeouts on the seven others, the second with a NaN loss first on rank 6;
- ``plogs``: CANN debug plogs (INFO/EVENT chatter of HCCL and the runtime) of 8 ranks, each
  ending in an HCCL socket-establish timeout;
- ``msprobe_tree``: msprobe monitor output (V1: one CSV per rank, family and step) of many
  steps x hundreds of parameters, NaN from a late step on rank 3 then everywhere.
"""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass
from pathlib import Path

from nanwatch.demo.simulate import TrainingRun

from .msprobe_ingest import write_step

LINE_BYTES = 705  # an 8-rank DINO iteration line with 25 loss terms, on average
SHORT_BYTES = 300  # the same with the total loss and the first two terms only
_SHORT_PARTS = 13  # "  "-separated parts of an iteration line kept for the short variant


@dataclass
class MmengineLogs:
    root: Path
    files: list[Path]
    bytes: int
    iteration_lines: int  # every one of them must give a metrics row
    expected: list[tuple[str, int]]  # (incident kind, origin rank)


def mmengine_logs(
    root: Path, mb: float, *, ranks: int = 8, seed: int = 0, short: bool = False
) -> MmengineLogs:
    """About ``mb`` MB of 8-rank mmengine logs in two launches of one work_dir; ``short``:
    ~300-byte iteration lines (a model with three loss terms) instead of ~705-byte ones."""
    per_rank = max(40, int(mb * 1e6 / (SHORT_BYTES if short else LINE_BYTES) / ranks))
    work_dir = root / "work_dirs" / "dino-4scale_r50_8xb2-12e_coco"
    # launch A: two training epochs, then validation where rank 3 runs out of NPU memory (the
    # validation loop runs when the third epoch would start)
    iters_a = max(10, per_rank // 4)
    run_a = TrainingRun(
        work_dir,
        timestamp="20261130_101500",
        ranks=ranks,
        epochs=3,
        iters=iters_a,
        nan_rank=None,
        nan_at=None,
        val_after_epoch=2,
        oom_rank=3,
        oom_val_iter=40,
        seed=seed + 1,
    )
    # launch B: one long epoch whose loss turns NaN on rank 6 near its end
    iters_b = max(20, per_rank - 2 * iters_a)
    run_b = TrainingRun(
        work_dir,
        timestamp="20261201_090000",
        ranks=ranks,
        epochs=1,
        iters=iters_b,
        nan_rank=6,
        nan_at=(1, iters_b - 10),
        stop_after_nan=6,
        start=dt.datetime(2026, 12, 1, 9, 0, 0),
        seed=seed + 2,
    )
    files: list[Path] = []
    for run in (run_a, run_b):
        files += _write(run, short)
    iteration_lines = 0
    size = 0
    for f in files:
        data = f.read_bytes()
        size += len(data)
        iteration_lines += data.count(b" - mmengine - INFO - Epoch(")
    return MmengineLogs(
        root=root / "work_dirs",
        files=files,
        bytes=size,
        iteration_lines=iteration_lines,
        expected=[("oom", 3), ("nan", 6)],
    )


def _write(run: TrainingRun, short: bool = False) -> list[Path]:
    """TrainingRun.write without holding the whole run in memory."""
    run.launch_dir.mkdir(parents=True, exist_ok=True)
    handles = {
        r: open(run.rank_path(r), "w", encoding="utf-8", buffering=1 << 20)  # noqa: SIM115
        for r in range(run.ranks)
    }
    try:
        for line in run.lines():
            assert line.file is None
            text = line.text
            if short and " - mmengine - INFO - Epoch(" in text:
                text = "  ".join(text.split("  ")[:_SHORT_PARTS])
            handles[line.rank].write(text + "\n")
    finally:
        for h in handles.values():
            h.close()
    return [run.rank_path(r) for r in range(run.ranks)]


_PLOG_INFO = (
    "[INFO] HCCL({pid},python):{ts} [hccl_communicator.cc:{n}][{tid}]Entry-HcclAllReduce:"
    "tag[AllReduce_group_name_0], count[{count}], dataType[bfp16], op[sum], streamId[14], "
    "deviceLogicId[{rank}]",
    "[EVENT] HCCL({pid},python):{ts} [op_base.cc:{n}][{tid}][OpBaseInfo] opTag[AllReduce], "
    "algType[fullmesh-ring-NHR], rankSize[8], userRank[{rank}], dataSize[{count}]",
    "[INFO] RUNTIME({pid},python):{ts} [stream.cc:{n}] {tid} SubmitTask: stream_id=14, "
    "task_id={task}, task_type=12(NOTIFY_WAIT), device_id={rank}",
    "[INFO] GE({pid},python):{ts} [graph_manager.cc:{n}]{tid} RunGraphAsync:Run graph "
    "async, graph_id:{task}, session_id:0",
)


def plogs(root: Path, mb: float, *, ranks: int = 8, seed: int = 0) -> tuple[list[Path], int]:
    """CANN debug plogs: chatter, then each rank's HCCL link times out. Returns (files, bytes)."""
    rng = random.Random(seed)
    per_rank = int(mb * 1e6 / 170 / ranks)
    start = dt.datetime(2026, 11, 30, 10, 15, 0)
    files = []
    size = 0
    for rank in range(ranks):
        pid = 40000 + rank * 17
        folder = root / "ascend" / "log" / "debug" / f"device-{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"plog-{pid}_20261130101500123.log"
        out = []
        for i in range(per_rank):
            t = start + dt.timedelta(microseconds=i * 2371)
            ts = t.strftime("%Y-%m-%d-%H:%M:%S.") + f"{t.microsecond // 1000:03d}.{i % 1000:03d}"
            out.append(
                _PLOG_INFO[i % len(_PLOG_INFO)].format(
                    pid=pid,
                    ts=ts,
                    n=rng.randrange(100, 4000),
                    tid=pid + 11,
                    rank=rank,
                    count=rng.choice((1048576, 524288, 262144)),
                    task=i,
                )
            )
        t = start + dt.timedelta(microseconds=per_rank * 2371 + 120_000_000)
        ts = t.strftime("%Y-%m-%d-%H:%M:%S.") + f"{t.microsecond // 1000:03d}.000"
        out.append(
            f"[ERROR] HCCL({pid},python):{ts} [hccl_socket_manager.cc:778] [{pid + 11}][Wait]"
            f"[LinkEstablish]wait socket establish timeout, role[1] rank[{rank}] timeout[120]"
        )
        text = "\n".join(out) + "\n"
        path.write_text(text)
        size += len(text)
        files.append(path)
    return files, size


def msprobe_tree(root: Path, *, ranks: int, steps: int, params: int) -> tuple[int, int]:
    """msprobe V1 monitor output under ``root``; returns (rows, bytes)."""
    rows = 0
    nan_at = int(steps * 0.8)
    for r in range(ranks):
        d = root / "monitor_output" / f"Dec01_10-00-00-rank{r}-{r:08x}"
        d.mkdir(parents=True)
        for s in range(steps):
            rows += write_step(d, s, params, s > nan_at or (s == nan_at and r == 3))
    size = sum(f.stat().st_size for f in root.rglob("*.csv"))
    return rows, size
