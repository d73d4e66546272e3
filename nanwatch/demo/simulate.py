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
from collections.abc import Callable, Iterator
from dataclasses import field
from pathlib import Path
from typing import Any

from .._dc import dataclass

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
    file: str | None = None  # relative to the launch folder; None: the rank's log


# A DINO-like model's parameters (named_parameters order) and shapes, for msprobe output.
DINO_PARAMS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("backbone.conv1.weight", (64, 3, 7, 7)),
    ("backbone.layer1.0.conv1.weight", (64, 64, 1, 1)),
    ("encoder.layers.0.self_attn.sampling_offsets.weight", (256, 256)),
    ("encoder.layers.0.self_attn.attention_weights.weight", (128, 256)),
    ("decoder.layers.0.cross_attn.value_proj.weight", (256, 256)),
    ("query_embedding.weight", (900, 256)),
    ("dn_query_generator.label_embedding.weight", (80, 256)),
    ("bbox_head.cls_branches.0.weight", (80, 256)),
    ("bbox_head.cls_branches.1.weight", (80, 256)),
    ("bbox_head.reg_branches.0.0.weight", (256, 256)),
)
MSPROBE_HEADER = "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype"


def _shape(s: tuple[int, ...]) -> str:
    text = "[" + ", ".join(str(x) for x in s) + "]"
    return f'"{text}"' if len(s) > 1 else text


def msprobe_row(
    name: str, step: int, shape: tuple[int, ...], rng: random.Random, *, nan: int = 0
) -> str:
    """One V1 gradient row; ``nan`` non-finite elements make norm/min/max/mean ``nan``."""
    if nan:
        return f"0,module.{name},{step},nan,nan,nan,nan,{nan},0.0,{_shape(shape)},torch.float32"
    norm = rng.uniform(0.01, 2.0)
    return (
        f"0,module.{name},{step},{norm:.8f},{-norm / 10:.8f},{norm / 10:.8f},"
        f"{rng.uniform(-1e-4, 1e-4):.8f},0,0.0,{_shape(shape)},torch.float32"
    )


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
    msprobe_nan_step: int | None = None  # msprobe step whose backward makes NaN on nan_rank
    msprobe_from: int = 0  # first step msprobe records (a monitor switched on late)
    msprobe_per_record: int = 10  # msprobe's step_count_per_record
    val_after_epoch: int | None = None  # run a validation loop after this epoch
    val_iters: int = 50
    val_interval: int = 10
    oom_rank: int | None = None  # this rank runs out of memory in validation ...
    oom_val_iter: int = 40  # ... at this validation iteration
    hccl_timeout: float = 1800.0  # the others' EI0002 arrives this long after the OOM
    config: str | None = None  # the config dump mmengine writes into the work_dir

    def _write_config(self) -> None:
        if self.config is not None:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            (self.work_dir / f"{self.work_dir.name}.py").write_text(self.config)

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
            if self.val_after_epoch is not None and epoch == self.val_after_epoch + 1:
                yield from self._validation(epoch - 1, t, rng)
                if self.oom_rank is not None:
                    return
            for it in range(1, self.iters + 1):
                t += self.step_time * (1 + rng.uniform(-0.03, 0.03))
                step = (epoch - 1) * self.iters + it - 1  # msprobe counts optimizer steps from 0
                if self.msprobe_nan_step is not None and step >= self.msprobe_from:
                    yield from self._msprobe_step(step, t, rng)
                if it % self.log_interval:
                    continue
                now = self.start + _dt.timedelta(seconds=t + 5)
                if self.msprobe_nan_step is not None:
                    # NaN born in a backward shows in the loss of the iteration after it
                    nan_step = step >= self.msprobe_nan_step + 1
                else:
                    nan_step = self.nan_at is not None and (epoch, it) >= self.nan_at
                for r in range(self.ranks):
                    bad = nan_step and (
                        self.msprobe_nan_step is not None
                        or (epoch, it) > self.nan_at  # type: ignore[operator]
                        or r == self.nan_rank
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

    def monitor_folder(self, rank: int) -> str:
        """msprobe's per-rank folder: Asia/Shanghai start time, rank, an id."""
        sh = self.start + _dt.timedelta(hours=8)
        return f"monitor_output/{sh:%b%d_%H-%M-%S}-rank{rank}-{0x5EED0000 + rank:08x}"

    def _msprobe_step(self, step: int, t: float, rng: random.Random) -> Iterator[Line]:
        """grad_unreduced / grad_reduced rows of one optimizer step on every rank."""
        n = self.msprobe_per_record
        start = (step // n) * n
        bad = self.msprobe_nan_step
        assert bad is not None
        for r in range(self.ranks):
            folder = self.monitor_folder(r)
            for family in ("grad_unreduced", "grad_reduced"):
                path = f"{folder}/{family}_{start}-{start + n - 1}.csv"
                if step == start or step == self.msprobe_from:
                    yield Line(t, r, MSPROBE_HEADER, path)
                # backward completes in roughly reversed order; the optimizer reads in order
                params = DINO_PARAMS[::-1] if family == "grad_unreduced" else DINO_PARAMS
                for name, shape in params:
                    nan = 0
                    if step > bad:
                        nan = shape[0] * shape[1]  # NaN weights: every gradient after
                    elif (
                        step == bad
                        and "label_embedding" in name
                        and (family == "grad_reduced" or r == self.nan_rank)
                    ):
                        nan = shape[1]  # one embedding row: the empty input's backward
                    yield Line(t, r, msprobe_row(name, step, shape, rng, nan=nan), path)

    def _validation(self, epoch: int, t: float, rng: random.Random) -> Iterator[Line]:
        """Validation after ``epoch``; the OOM rank dies in it and the others time out."""
        for it in range(self.val_interval, self.val_iters + 1, self.val_interval):
            t += 0.24 * self.val_interval
            now = self.start + _dt.timedelta(seconds=t + 5)
            for r in range(self.ranks):
                if self.oom_rank is not None and it >= self.oom_val_iter:
                    continue
                yield Line(
                    t,
                    r,
                    mmengine_iter_line(
                        now,
                        "val",
                        epoch,
                        it,
                        self.val_iters,
                        step_time=0.2409,
                        data_time=0.0010,
                        memory=984,
                        lr=None,
                        eta="0:00:12",
                    ),
                )
            if self.oom_rank is not None and it >= self.oom_val_iter:
                for text in npu_oom_traceback(self.oom_rank):
                    yield Line(t, self.oom_rank, text)
                for r in range(self.ranks):
                    if r == self.oom_rank:
                        continue
                    when = self.start + _dt.timedelta(
                        seconds=t + 5 + self.hccl_timeout + rng.uniform(0.5, 3.0)
                    )
                    for text in hccl_ei0002(when, r, self.oom_rank, pid=12000 + r):
                        yield Line(t + self.hccl_timeout, r, text)
                return

    def write(self) -> list[Path]:
        """Write the whole run at once (for scan tests); returns the rank files."""
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        texts: dict[Path, list[str]] = {self.rank_path(r): [] for r in range(self.ranks)}
        for line in self.lines():
            texts.setdefault(self._path(line), []).append(line.text + "\n")
        for path, lines in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(lines), encoding="utf-8")
        return [self.rank_path(r) for r in range(self.ranks)]

    def _path(self, line: Line) -> Path:
        return self.launch_dir / line.file if line.file else self.rank_path(line.rank)

    def feed(self, at_point: Callable[[float], None], *, every: int = 200) -> None:
        """Append the lines in their fixed order, calling ``at_point(simulated seconds since the
        start)`` with everything written so far flushed: after the last line, and at the
        end of a simulated instant once ``every`` lines were written since the last point (or
        before a quiet stretch). The same run always stops at the same points, so what a reader
        makes of it at each point is the same every time (the demo's replay)."""
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        handles: dict[Path, Any] = {}
        written = 0
        now: float | None = None

        touched: set[Path] = set()

        def point(t: float) -> None:
            nonlocal written
            # files look written at the simulated time (msprobe rows carry no time of their
            # own: readers take the file's mtime)
            when = (self.start + _dt.timedelta(seconds=t)).timestamp()
            for path in touched:
                handles[path].flush()
                os.utime(path, (when, when))
            touched.clear()
            at_point(t)
            written = 0

        try:
            for line in self.lines():
                if now is not None and line.t != now and (written >= every or line.t - now > 60):
                    point(now)
                now = line.t
                path = self._path(line)
                if path not in handles:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    handles[path] = open(path, "a", encoding="utf-8")  # noqa: SIM115
                handles[path].write(line.text + "\n")
                touched.add(path)
                written += 1
            point(now or 0.0)
        finally:
            for h in handles.values():
                h.close()

    def replay(
        self,
        speed: float = 50.0,
        stop: threading.Event | None = None,
        *,
        max_pause: float | None = None,
    ) -> None:
        """Append the lines in simulated time divided by ``speed``; long quiet stretches (the
        1800 s before a collective times out) last at most ``max_pause`` real seconds."""
        self.launch_dir.mkdir(parents=True, exist_ok=True)
        self._write_config()
        handles = {
            self.rank_path(r): open(self.rank_path(r), "a", encoding="utf-8")  # noqa: SIM115
            for r in range(self.ranks)
        }
        t0 = time.monotonic()
        skipped = 0.0
        last_t = 0.0
        try:
            for line in self.lines():
                if stop is not None and stop.is_set():
                    return
                gap = (line.t - last_t) / speed
                if max_pause is not None and gap > max_pause:
                    skipped += gap - max_pause
                last_t = max(last_t, line.t)
                due = t0 + line.t / speed - skipped
                delay = due - time.monotonic()
                if delay > 0:
                    for h in handles.values():
                        h.flush()
                    if stop is not None:
                        if stop.wait(delay):
                            return
                    else:
                        time.sleep(delay)
                path = self._path(line)
                if path not in handles:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    handles[path] = open(path, "a", encoding="utf-8")  # noqa: SIM115
                handles[path].write(line.text + "\n")
        finally:
            for h in handles.values():
                h.flush()
                os.fsync(h.fileno())
                h.close()


def npu_oom_traceback(rank: int) -> list[str]:
    """torch_npu's OOM in an mmengine validation step (tracebacks carry no timestamp)."""
    site = "/usr/local/python3.9.18/lib/python3.9/site-packages"
    return [
        "Traceback (most recent call last):",
        '  File "tools/train.py", line 121, in <module>',
        "    main()",
        '  File "tools/train.py", line 117, in main',
        "    runner.train()",
        f'  File "{site}/mmengine/runner/runner.py", line 1777, in train',
        "    model = self.train_loop.run()  # type: ignore",
        f'  File "{site}/mmengine/runner/loops.py", line 102, in run',
        "    self.runner.val_loop.run()",
        f'  File "{site}/mmengine/runner/loops.py", line 373, in run',
        "    self.run_iter(idx, data_batch)",
        f'  File "{site}/mmengine/runner/loops.py", line 393, in run_iter',
        "    outputs = self.runner.model.val_step(data_batch)",
        f'  File "{site}/mmengine/model/wrappers/distributed.py", line 141, in val_step',
        "    return self.module.val_step(data)",
        f'  File "{site}/mmdet/models/detectors/dino.py", line 212, in forward_transformer',
        "    memory = self.encoder(**encoder_inputs_dict)",
        f"RuntimeError: NPU out of memory. Tried to allocate 1.17 GiB (NPU {rank}; 60.97 GiB "
        "total capacity; 57.32 GiB already allocated; 57.32 GiB current active; 612.34 MiB free; "
        "59.61 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try "
        "setting max_split_size_mb to avoid fragmentation.",
    ]


def hccl_ei0002(when: _dt.datetime, rank: int, remote: int, *, pid: int) -> list[str]:
    """What torch_npu prints on a rank whose collective waited for a dead rank."""
    day = when.strftime("%Y-%m-%d-%H:%M:%S")
    frac = f"{when.microsecond // 1000:03d}.{when.microsecond % 1000:03d}"
    return [
        "Traceback (most recent call last):",
        '  File "tools/train.py", line 121, in <module>',
        "    main()",
        "RuntimeError: InnerRun:torch_npu/csrc/framework/OpParamMaker.cpp:208 NPU function "
        "error: c10_npu::acl::AclrtSynchronizeStreamWithTimeout(stream), error code is 507048",
        f"[ERROR] {day} (PID:{pid}, Device:{rank}, RankID:{rank}) ERR00100 PTA call acl api failed",
        "[Error]: The execution of the internal task times out. ",
        "        Rectify the fault based on the error information in the ascend log.",
        f"EI0002: [PID: {pid}] {day}.{frac} The wait execution of the Notify register times out. "
        f"Reason: The Notify register has not received the Notify record from remote rank: "
        f"[{remote}]. base information: [streamID:[14], taskID[4], tag[AllReduce_group_name_0], "
        "AlgType(level 0-1-2):[fullmesh-ring-NHR]]. task information: []",
        "        Possible Cause: 1. An exception occurs during the execution on some NPUs in the "
        "cluster. As a result, collective communication operation failed.2. The execution speed "
        "on some NPU in the cluster is too slow to complete a communication operation within "
        "the timeout interval. (default 1800s, You can set the interval by using "
        "HCCL_EXEC_TIMEOUT.)",
    ]


def seed_scenario(
    base: Path, *, ranks: int = 8, iters: int = 200
) -> tuple[TrainingRun, TrainingRun]:
    """The seed case in two launches of one experiment (one work_dir).

    Run A: rank 3 runs out of NPU memory in validation after epoch 2; the seven other ranks
    hit HCCL EI0002 about 1800 s later, naming remote rank 3.
    Run B: validation off, every step ~3.3x slower (grid_sample on the CPU), msprobe's monitor
    on: the unreduced gradient of ``label_embedding`` goes NaN on rank 6 first (an empty
    embedding input on CANN < 8.0.0), the reduced gradients on every rank, then the loss.
    ``iters`` per epoch sets the length (the demo uses 100).
    """
    work_dir = base / "work_dirs" / "dino-4scale_r50_8xb2-12e_coco"
    run_a = TrainingRun(
        work_dir,
        config=dino_config(base / "data", validation=True),
        timestamp="20261130_101500",
        ranks=ranks,
        epochs=3,
        iters=iters,
        log_interval=10,
        step_time=0.86,
        nan_rank=None,
        nan_at=None,
        val_after_epoch=2,
        oom_rank=3,
        oom_val_iter=40,
        seed=1,
    )
    # the NaN is born in epoch 3 (epoch 2 for short runs), at 64% of it: the loss of the next
    # logged iteration is NaN; msprobe is switched on a little before it
    nan_step = (2 if iters >= 200 else 1) * iters + iters * 64 // 100 - 1
    run_b = TrainingRun(
        work_dir,
        config=dino_config(base / "data", validation=False),
        timestamp="20261201_090000",
        ranks=ranks,
        epochs=4 if iters >= 200 else 3,
        iters=iters,
        log_interval=10,
        step_time=2.84,
        nan_rank=6,
        nan_at=None,
        msprobe_nan_step=nan_step,
        msprobe_from=nan_step - 27,
        stop_after_nan=3,
        start=_dt.datetime(2026, 12, 1, 9, 0, 0),
        seed=2,
    )
    return run_a, run_b


def dino_config(data_root: Path, *, validation: bool) -> str:
    """The parts of an mmdet DINO config dump that hints read (dataset, batch sizes)."""
    val = (
        "val_cfg = dict(type='ValLoop')\n"
        "val_dataloader = dict(\n    batch_size=8,\n    dataset=dict(\n"
        "        ann_file='annotations/instances_val.json',\n"
        f"        data_root='{data_root}/',\n        type='CocoDataset'),\n    num_workers=2)\n"
        "val_evaluator = dict(type='CocoMetric')\n"
        if validation
        else "val_cfg = None\nval_dataloader = None\nval_evaluator = None\n"
    )
    return (
        "auto_scale_lr = dict(base_batch_size=16)\n"
        f"data_root = '{data_root}/'\n"
        "default_scope = 'mmdet'\n"
        "metainfo = dict(classes=('person', 'car', 'bicycle'))\n"
        "train_cfg = dict(max_epochs=12, type='EpochBasedTrainLoop', val_interval=1)\n"
        "train_dataloader = dict(\n    batch_size=2,\n    dataset=dict(\n"
        "        ann_file='annotations/instances_train.json',\n"
        f"        data_root='{data_root}/',\n"
        "        filter_cfg=dict(filter_empty_gt=False, min_size=32),\n"
        "        metainfo=dict(classes=('person', 'car', 'bicycle')),\n"
        "        type='CocoDataset'),\n    num_workers=2)\n" + val
    )


def demo_scenario(base: Path, *, ranks: int = 8) -> tuple[TrainingRun, TrainingRun]:
    """The seed case, shortened for `nanwatch demo` (the same story as :func:`seed_scenario`)."""
    return seed_scenario(base, ranks=ranks, iters=100)
