"""A real mmengine training on CPU torch with one poisoned sample, while `watch` runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import StartWatch, nanwatch, wait_for
from ..integration.test_kill import event_count

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TRAIN = Path(__file__).parent.parent / "e2e" / "mmengine_train.py"


def test_first_nan_of_a_real_mmengine_run(tmp_path: Path, start_watch: StartWatch) -> None:
    pytest.importorskip("mmengine")
    work = tmp_path / "work_dirs" / "toy"
    work.mkdir(parents=True)
    db = tmp_path / "nw.db"
    watch = start_watch(work, db=db, quiet=False)
    with (work / "stdout.log").open("wb") as stdout:
        train = subprocess.run(
            [sys.executable, str(TRAIN), str(work), "9", "2"],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert train.returncode == 0, (work / "stdout.log").read_text()[-3000:]
    # 23 NaN lines in mmengine's log file and again in the captured stdout
    wait_for(lambda: event_count(db) >= 46, timeout=60, what="the NaN events")
    assert watch.stop() == 0, watch.output()[-3000:]
    events = [
        json.loads(x)
        for x in nanwatch("events", "--db", str(db), "--json", "--kind", "nan").stdout.splitlines()
    ]
    first = min(events, key=lambda e: (e["step"], e["id"]))
    assert (first["epoch"], first["iter"], first["stage"], first["step"]) == (1, 10, "train", 10)
    incidents = [
        json.loads(x) for x in nanwatch("incidents", "--db", str(db), "--json").stdout.splitlines()
    ]
    assert [i["kind"] for i in incidents] == ["nan"]
    o = incidents[0]["origin"]
    assert (o["epoch"], o["iter"], o["stage"]) == (1, 10, "train")
    # the launch folder, the config dump and stdout are one run
    runs = [json.loads(x) for x in nanwatch("runs", "--db", str(db), "--json").stdout.splitlines()]
    assert len(runs) == 1 and runs[0]["experiment"] == "toy"
