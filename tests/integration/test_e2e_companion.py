"""A real 2-rank mmengine training (torchrun, gloo on CPU) with NanwatchHook, while `watch` runs.

Two images have empty ground truth (rank 1's iteration 7, rank 0's iteration 9); the loss turns
NaN at iteration 10. nanwatch must record the run's facts, name exactly those two images with
their iterations, and link them to the NaN incident.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nanwatch.detect import companion

from ..conftest import StartWatch, nanwatch, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TRAIN = Path(__file__).parent.parent / "e2e" / "mmengine_hook_train.py"
IMAGE = "data/coco/train2017/{:012d}.jpg"


def _linked(db: Path) -> int:
    """Images linked to the NaN incident so far."""
    if not db.exists():
        return 0
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            row = conn.execute(
                "SELECT detail FROM incidents WHERE kind = 'nan' ORDER BY id LIMIT 1"
            ).fetchone()
        finally:
            conn.close()
    except sqlite3.Error:
        return 0
    related = json.loads(row[0] or "{}").get("related_data_issues", []) if row else []
    return len({d.get("image") for d in related})


def _json_lines(*args: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in nanwatch(*args).stdout.splitlines()]


def test_hook_facts_and_empty_ground_truth_of_a_real_mmengine_run(
    tmp_path: Path, start_watch: StartWatch
) -> None:
    mmengine = pytest.importorskip("mmengine")
    torch = pytest.importorskip("torch")
    work = tmp_path / "work_dirs" / "dino"
    work.mkdir(parents=True)
    db = tmp_path / "nw.db"
    watch = start_watch(work, db=db, quiet=False)
    env = {**os.environ, "SLURM_JOB_ID": "4242", "HCCL_EXEC_TIMEOUT": "3600"}
    # torchrun and mmengine print a banner before mmengine's launch folder exists when these
    # are unset; stdout.log would then be read as a run of its own
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)  # torchrun sets its own
    with (work / "stdout.log").open("wb") as stdout:
        train = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(TRAIN),
                str(work),
            ],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=300,
        )
    assert train.returncode == 0, (work / "stdout.log").read_text()[-3000:]
    wait_for(lambda: _linked(db) >= 2, timeout=60, what="the samples linked to the NaN")
    assert watch.stop() == 0, watch.output()[-3000:]

    # the run's facts: one run (mmengine's launch folder, its config dump and stdout)
    (run,) = _json_lines("runs", "--db", str(db), "--json")
    f = run["facts"]
    assert (f["world_size"], f["rank"], f["local_rank"]) == (2, 0, 0)
    assert f["job"]["slurm_job_id"] == "4242"
    assert f["job"]["torchelastic_run_id"]  # set by torchrun in the training's environment
    assert f["job"]["master_addr"] and isinstance(f["job"]["master_port"], int)
    v = f["versions"]
    assert (v["torch"], v["mmengine"]) == (torch.__version__, mmengine.__version__)
    assert v["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert "cann" not in v and "torch_npu" not in v  # no torch_npu: unknown
    assert f["device"]["type"] == "cpu" and f["backend"] == "gloo"
    assert f["timeouts"]["HCCL_EXEC_TIMEOUT"] == 3600 and f["timeouts"]["pg_timeout"] == 900
    assert f["work_dir"] == str(work)
    assert f["determinism"]["seed"] == 0

    # exactly the two images, with their ranks and iterations (each record is read from
    # mmengine's log file and from the captured stdout when rank 0 printed it)
    issues = _json_lines("events", "--db", str(db), "--json", "--kind", "data_issue")
    seen = {
        (e["fields"]["image"], e["fields"]["image_id"], e["rank"], e["epoch"], e["iter"])
        for e in issues
    }
    assert seen == {(IMAGE.format(25), 25, 1, 1, 7), (IMAGE.format(34), 34, 0, 1, 9)}
    assert {e["incident"] for e in issues} == {None}

    # the NaN at iteration 10 links them
    (inc,) = [i for i in _json_lines("incidents", "--db", str(db), "--json") if i["kind"] == "nan"]
    assert (inc["origin"]["epoch"], inc["origin"]["iter"]) == (1, 10)
    related = inc["detail"]["related_data_issues"]
    assert {(d["image"], d["rank"], d["iter"]) for d in related} == {
        (IMAGE.format(25), 1, 7),
        (IMAGE.format(34), 0, 9),
    }
    assert "empty-gt-samples-seen" in [h["id"] for h in inc["hints"]]
    # validation was marked on both ranks (rank 0 through its logger, rank 1 on stderr)
    marks = [
        (d["rank"], d["stage"], d["event"])
        for line in (work / "stdout.log").read_text().splitlines()
        if (rec := companion.parse(line)) and rec[0] == "STAGE" and (d := rec[1])["stage"] == "val"
    ]
    assert sorted(marks) == [
        (0, "val", "end"),
        (0, "val", "start"),
        (1, "val", "end"),
        (1, "val", "start"),
    ]
    text = nanwatch("show", str(inc["id"]), "--db", str(db)).stdout
    assert f"rank 1, epoch 1, iter 7: {IMAGE.format(25)} (image_id 25)" in text
    assert f"rank 0, epoch 1, iter 9: {IMAGE.format(34)} (image_id 34)" in text
