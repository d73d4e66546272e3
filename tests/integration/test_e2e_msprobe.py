"""A real 2-rank DDP training (gloo, CPU) under msprobe's TrainerMon while `watch` runs.

Rank 1's embedding makes NaN in its own backward at msprobe step 3 (its forward and the gradient
arriving at its output stay finite); DDP's all-reduce makes the reduced gradients NaN on both
ranks. nanwatch must name rank 1, step 3, the unreduced gradient of the embedding's weight.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import StartWatch, nanwatch, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TRAIN = Path(__file__).parent.parent / "e2e" / "msprobe_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _incidents(db: Path) -> list[dict[str, object]]:
    out = nanwatch("incidents", "--db", str(db), "--json", check=False)
    return [json.loads(x) for x in out.stdout.splitlines()] if out.returncode == 0 else []


def test_first_nan_of_a_real_msprobe_ddp_run(tmp_path: Path, start_watch: StartWatch) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("msprobe")
    job = tmp_path / "job"
    job.mkdir()
    db = tmp_path / "nw.db"
    watch = start_watch(job, db=db, quiet=False)
    with (job / "stdout.log").open("wb") as stdout:
        train = subprocess.run(
            [
                sys.executable,
                str(TRAIN),
                str(job),
                "--ranks=2",
                "--steps=6",
                "--nan-rank=1",
                "--nan-step=3",
                "--nan-in=embedding",
                # steps a little apart, so the monitor's files come while `watch` follows
                # them; the run is over before any assertion, none depends on this
                "--pause=0.2",
                f"--port={_free_port()}",
            ],
            stdout=stdout,
            stderr=subprocess.STDOUT,
            timeout=240,
        )
    assert train.returncode == 0, (job / "stdout.log").read_text()[-3000:]

    def located() -> bool:
        incs = _incidents(db)
        return bool(incs) and incs[0]["origin"].get("first_param") is not None  # type: ignore[union-attr]

    wait_for(located, timeout=60, what="the NaN incident")
    assert watch.stop() == 0, watch.output()[-3000:]

    incidents = _incidents(db)
    assert [i["kind"] for i in incidents] == ["nan"]
    inc = incidents[0]
    o = inc["origin"]
    assert isinstance(o, dict)
    assert (o["rank"], o["step"], o["tag"], o["tensor"], o["shape"]) == (
        1,
        3,
        "grad_unreduced",
        "module.embedding.weight",
        [16, 8],
    )
    assert (o["phase"], o["module"], o["stage"]) == ("backward", "embedding", "train")
    assert o["first_param"] == {
        "tensor": "module.embedding.weight",
        "tag": "grad_unreduced",
        "shape": [16, 8],
        "step": 3,
    }
    assert inc["ranks"] == [0, 1]
    detail = inc["detail"]
    assert isinstance(detail, dict)
    assert "inside the backward of `embedding`" in detail["root_cause"]
    followed = {(f["step"], f["tag"]): f["ranks"] for f in detail["followed"]}
    assert followed[(3, "grad_unreduced")] == [1]
    assert followed[(3, "grad_reduced")] == [0, 1]
    # placeholders (the embedding's token-id input has no gradient) never became events
    events = [
        json.loads(x)
        for x in nanwatch("events", "--db", str(db), "--json", "--kind", "nan").stdout.splitlines()
    ]
    tensors = {e["fields"].get("tensor") for e in events}
    assert "module.embedding.input" not in tensors and ".input" not in tensors
    assert min(e["step"] for e in events if e["step"] is not None) == 3
    story = nanwatch("show", "--db", str(db), str(inc["id"])).stdout
    assert "rank 0: unreduced gradients finite" in story
    # the stdout log and the monitor output are one run
    runs = [json.loads(x) for x in nanwatch("runs", "--db", str(db), "--json").stdout.splitlines()]
    assert [r["name"] for r in runs] == ["job"]
