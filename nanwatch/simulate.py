"""Realistic multi-rank training output, written by nanwatch itself (demo, tests, benchmarks).

The lines follow the formats real tools print (mmengine LogProcessor lines, tracebacks, ...);
times advance in simulated seconds and can be replayed faster than real time.
"""

from __future__ import annotations

import datetime as _dt
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

DINO_LOSSES = (
    ["loss_cls", "loss_bbox", "loss_iou"]
    + [f"d{i}.{k}" for i in range(5) for k in ("loss_cls", "loss_bbox", "loss_iou")]
    + [
        "enc_loss_cls",
        "enc_loss_bbox",
        "enc_loss_iou",
        "dn_loss_cls",
        "dn_loss_bbox",
        "dn_loss_iou",
    ]
)


def mm_time(t: _dt.datetime) -> str:
    return t.strftime("%Y/%m/%d %H:%M:%S")


def mmengine_header(t: _dt.datetime, work_dir: str, ranks: int) -> list[str]:
    ts = mm_time(t)
    return [
        f"{ts} - mmengine - INFO - ",
        "------------------------------------------------------------",
        "System environment:",
        "    sys.platform: linux",
        "    Python: 3.9.18 (main, Sep 11 2023, 13:41:44) [GCC 11.2.0]",
        "    CUDA available: False",
        "    numpy_random_seed: 42",
        "    GCC: gcc (GCC) 7.3.0",
        "    PyTorch: 2.1.0",
        "    TorchVision: 0.16.0",
        "    OpenCV: 4.9.0",
        "    MMEngine: 0.10.3",
        "",
        "Runtime environment:",
        "    cudnn_benchmark: False",
        "    dist_cfg: {'backend': 'hccl'}",
        "    seed: 42",
        "    Distributed launcher: pytorch",
        "    Distributed training: True",
        f"    GPU number: {ranks}",
        "------------------------------------------------------------",
        "",
        f"{ts} - mmengine - INFO - Config:",
        "auto_scale_lr = dict(base_batch_size=16)",
        "default_scope = 'mmdet'",
        f"work_dir = '{work_dir}'",
        "",
        f"{ts} - mmengine - INFO - Distributed training is not used, all SyncBatchNorm (SyncBN) "
        "layers in the model will be automatically reverted to BatchNormXd layers "
        "if they are used.",
        f"{ts} - mmengine - INFO - Checkpoints will be saved to {work_dir}.",
    ]


def mmengine_iter_line(
    t: _dt.datetime,
    stage: str,
    epoch: int,
    it: int,
    iters: int,
    *,
    step_time: float,
    data_time: float = 0.0123,
    memory: int | None = 21034,
    lr: float | None = 1e-4,
    losses: dict[str, float] | None = None,
    grad_norm: float | None = None,
    eta: str = "1 day, 2:03:04",
) -> str:
    width = len(str(iters))
    parts = [f"{mm_time(t)} - mmengine - INFO - Epoch({stage})  [{epoch}][{it:>{width}}/{iters}]"]
    if lr is not None:
        parts.append(f"base_lr: {lr:.4e} lr: {lr:.4e}")
    parts.append(f"eta: {eta}")
    parts.append(f"time: {step_time:.4f}")
    parts.append(f"data_time: {data_time:.4f}")
    if memory is not None:
        parts.append(f"memory: {memory}")
    if grad_norm is not None:
        parts.append(f"grad_norm: {_num(grad_norm)}")
    for k, v in (losses or {}).items():
        parts.append(f"{k}: {_num(v)}")
    return "  ".join(parts)


def _num(v: float) -> str:
    if v != v:
        return "nan"
    if v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return f"{v:.4f}"


@dataclass
class Line:
    t: float  # simulated seconds since start
    rank: int
    text: str


@dataclass
class TrainingRun:
    """An N-rank mmengine training whose loss turns NaN on one rank first (optional)."""

    work_dir: Path
    timestamp: str = "20261130_101500"
    ranks: int = 8
    epochs: int = 2
    iters: int = 16
    log_interval: int = 1
    step_time: float = 0.86
    start: _dt.datetime = field(default_factory=lambda: _dt.datetime(2026, 11, 30, 10, 15, 0))
    nan_rank: int | None = 6
    nan_at: tuple[int, int] | None = (1, 10)  # (epoch, iter)
    stop_after_nan: int = 6  # logged iterations after the NaN before the run is stopped
    seed: int = 0

    @property
    def launch_dir(self) -> Path:
        return self.work_dir / self.timestamp

    def rank_path(self, rank: int) -> Path:
        return self.launch_dir / f"rank{rank}.log"

    def lines(self) -> Iterator[Line]:
        rng = random.Random(self.seed)
        t = 0.0
        for r in range(self.ranks):
            for text in mmengine_header(self.start, str(self.work_dir), self.ranks):
                yield Line(0.0, r, text)
        after_nan = None
        for epoch in range(1, self.epochs + 1):
            for it in range(1, self.iters + 1):
                t += self.step_time * (1 + rng.uniform(-0.03, 0.03))
                if it % self.log_interval:
                    continue
                now = self.start + _dt.timedelta(seconds=t + 5)
                nan_step = self.nan_at is not None and (epoch, it) >= self.nan_at
                for r in range(self.ranks):
                    bad = nan_step and (
                        (epoch, it) > self.nan_at or r == self.nan_rank  # type: ignore[operator]
                    )
                    losses = {
                        k: (
                            float("nan")
                            if bad and k in ("loss_cls", "dn_loss_cls")
                            else rng.uniform(0.05, 1.2)
                        )
                        for k in DINO_LOSSES
                    }
                    total = float("nan") if bad else sum(losses.values())
                    yield Line(
                        t,
                        r,
                        mmengine_iter_line(
                            now,
                            "train",
                            epoch,
                            it,
                            self.iters,
                            step_time=self.step_time * (1 + rng.uniform(-0.03, 0.03)),
                            grad_norm=float("nan") if bad else rng.uniform(5, 40),
                            losses={"loss": total, **losses},
                        ),
                    )
                if nan_step:
                    after_nan = (after_nan or 0) + 1
                    if after_nan > self.stop_after_nan:
                        return

    def write(self) -> list[Path]:
        """Write the whole run at once (for scan tests); returns the rank files."""
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        texts: dict[int, list[str]] = {r: [] for r in range(self.ranks)}
        for line in self.lines():
            texts[line.rank].append(line.text + "\n")
        for r, lines in texts.items():
            self.rank_path(r).write_text("".join(lines), encoding="utf-8")
        return [self.rank_path(r) for r in range(self.ranks)]

    def replay(self, speed: float = 50.0, stop: threading.Event | None = None) -> None:
        """Append the lines in simulated time divided by ``speed``."""
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        handles = {
            r: open(self.rank_path(r), "a", encoding="utf-8")  # noqa: SIM115 - closed below
            for r in range(self.ranks)
        }
        t0 = time.monotonic()
        try:
            for line in self.lines():
                if stop is not None and stop.is_set():
                    return
                due = t0 + line.t / speed
                delay = due - time.monotonic()
                if delay > 0:
                    for h in handles.values():
                        h.flush()
                    if stop is not None:
                        if stop.wait(delay):
                            return
                    else:
                        time.sleep(delay)
                handles[line.rank].write(line.text + "\n")
        finally:
            for h in handles.values():
                h.flush()
                os.fsync(h.fileno())
                h.close()
