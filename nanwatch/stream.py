"""What a stream (one followed file) knows at its committed offset.

Stored as JSON with the offset, in the same transaction, so a restart resumes with the same
stage, epoch, iteration and line count it had.
"""

from __future__ import annotations

import json
from dataclasses import field, fields
from typing import Any

from ._dc import dataclass

# What a launcher or scheduler prints about the launch (context rules' groups of these names):
# the same on every node of one launch, so they name the job across nodes (sources/identity.py).
# a rank, epoch, iteration or step beyond this is not a position a run reaches (the database's
# columns are 64-bit): detect/bounds.py reads the text's numbers against it
STEP_LIMIT = 2**62

LAUNCH_KEYS = frozenset(
    {
        "slurm_job_id",
        "torchelastic_run_id",
        "master_addr",
        "master_port",
        "rdzv_endpoint",
        "mindx_job_name",
        "volcano_job_name",
        "mmengine_exp",
        "nproc_per_node",
        "group_rank",
        "nnodes",  # with the two above: a local rank's global rank on a multi-node job
    }
)


@dataclass
class StreamState:
    """What a stream knows at its committed offset; stored with the offset, in one transaction."""

    rank: int | None = None
    local_rank: int | None = None
    node: str | None = None
    device: str | None = None
    stage: str | None = None
    epoch: int | None = None
    iter: int | None = None
    iters: int | None = None
    step: int | None = None
    hint_stage: str | None = None
    hint_line: int = 0
    hint_weak: bool = False  # the hint stage came from the entry script, not a loop frame
    hint_stage_rank: int | None = None  # the rank whose line gave the hint stage (its prefix)
    # the rank whose announcement ("Evaluating ...") set `stage`, until the next iteration line:
    # another rank's failure is not in that stage (rank 0 evaluates alone)
    stage_rank: int | None = None
    hint_rank: int | None = None  # a rank named by a nearby error line (RankID:8)
    hint_rank_line: int = 0
    hint_local_rank: int | None = None  # a local rank named the same way (local_rank: 2)
    hint_rank_once: bool = False  # the hint rank is a record's prefix: only its next event's
    hint_rank_pid: int | None = None  # the PID the line that named the hint rank printed
    # process id (a Ray actor's "pid=5012" prefix) -> the rank one of its lines named; replaced,
    # never mutated in place
    pid_ranks: dict[str, int] | None = None
    progress_line: int = 0  # the last iteration line: failure reports do not span it
    # open failure reports, by rank ("?" unknown): [kind family, last line, priority, kind, pid
    # (the process the report is about, or None)]
    blocks: dict[str, list[Any]] = field(default_factory=dict)
    # open records (tracebacks) by rank ("?" unknown): [name, line it opened on]; replaced,
    # never mutated in place
    records: dict[str, list[Any]] | None = None
    last_time: str | None = None
    # the rank the in-process companion announced in this stream; -1: several did (a shared one)
    announced: int | None = None
    line_no: int = 0  # complete lines consumed before the committed offset
    first_epoch: int | None = None  # 0 once the stream printed an epoch 0: its epochs are 0-based
    # structured readers (msprobe CSV / dumps): header, row position, family counts; replaced,
    # never mutated in place, because the pipeline copies states shallowly
    msprobe: dict[str, Any] | None = None
    # launch identity the stream printed (LAUNCH_KEYS -> text); replaced, never mutated in place
    launch: dict[str, str] | None = None
    # the last value of each counter a `rising` rule reads ("rule id:rank" -> value); replaced,
    # never mutated in place
    counters: dict[str, int] | None = None
    # loss-scale overflow notices in a row, by rank ("?" unknown): [notices, first scale, last
    # scale, last line, reported]; replaced, never mutated in place
    overflow_runs: dict[str, list[Any]] | None = None

    def follow_step(self, step_given: bool) -> None:
        """Epoch-based loops print the iteration within the epoch; the global step follows:
        ``(epoch - 1) * iters + iter``, or ``epoch * iters + iter`` once the stream has shown
        that it counts epochs from 0 (DeiT/MAE's "Epoch: [0]"), never a negative step."""
        if self.epoch == 0:
            self.first_epoch = 0
        if step_given or self.stage not in (None, "train"):
            return
        if self.epoch is not None and self.iter is not None and self.iters:
            done = self.epoch if self.first_epoch == 0 else self.epoch - 1
            step = max(done, 0) * self.iters + self.iter
            self.step = step if step < STEP_LIMIT else None  # not a position a run reaches
        elif self.iter is not None and self.epoch is None:
            self.step = self.iter

    def to_json(self) -> str:
        # only absent values are left out: rank 0, epoch 0 and step 0 are real values; json
        # walks the nested dicts itself (asdict's deep copy cost more than the dump, per chunk)
        values = ((k, getattr(self, k)) for k in _FIELDS)
        return json.dumps({k: v for k, v in values if v is not None and v != {}})

    @classmethod
    def from_json(cls, text: str | None) -> StreamState:
        if not text:
            return cls()
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


_FIELDS = tuple(f.name for f in fields(StreamState))
