"""First-NaN localisation on msprobe output written here, in msprobe's V1 format."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.query import list_incidents, list_runs
from nanwatch.store import Store

MICRO = "vpp_stage,name,step,micro_step,norm,min,max,mean,nans,zeros,shape,dtype\n"
PLAIN = "vpp_stage,name,step,norm,min,max,mean,nans,zeros,shape,dtype\n"
MICRO_FAMILIES = ("actv", "actv_grad")
MODEL = ["embedding", "layers.0", "layers.1", "output_layer"]


def row(name: str, step: int, nan: bool, shape: str, micro: int | None) -> str:
    m = f"{micro}," if micro is not None else ""
    if nan:
        return f'0,{name},{step},{m}nan,nan,nan,nan,8,0.0,"{shape}",torch.float32\n'
    return f'0,{name},{step},{m}0.5,-0.1,0.1,0.01,0,0.0,"{shape}",torch.float32\n'


def placeholder(name: str, step: int, micro: int | None = 0) -> str:
    m = f"{micro}," if micro is not None else ""
    return f"0,{name},{step},{m}nan,nan,nan,nan,nan,nan,nan,nan\n"


class Tree:
    """msprobe V1 output for a 4-module DDP model; each (rank, step, family) file is one write."""

    def __init__(self, root: Path, ranks: int, stamp: str = "Dec01_10-00-00") -> None:
        self.root = root
        self.mon = root / "monitor_output"
        self.dirs = {r: self.mon / f"{stamp}-rank{r}-{r:08x}" for r in range(ranks)}
        for d in self.dirs.values():
            d.mkdir(parents=True, exist_ok=True)

    def write(
        self,
        rank: int,
        family: str,
        step: int,
        nan: set[str],
        extra: str = "",
        micro: int | None = None,
        name: str | None = None,
    ) -> None:
        if micro is None and family in MICRO_FAMILIES:
            micro = 0
        lines = []
        if family == "actv":
            for m in MODEL:
                lines.append(row(f"module.{m}.input", step, f"{m}.input" in nan, "[4, 8]", micro))
                lines.append(row(f"module.{m}.output", step, f"{m}.output" in nan, "[4, 8]", micro))
        elif family == "actv_grad":
            lines.append(placeholder(".input", step))
            lines.append(row(".output", step, ".output" in nan, "[4, 4]", micro))
            for m in reversed(MODEL):
                if m == "embedding":
                    lines.append(placeholder("module.embedding.input", step))
                else:
                    lines.append(
                        row(f"module.{m}.input", step, f"{m}.input" in nan, "[4, 8]", micro)
                    )
                lines.append(row(f"module.{m}.output", step, f"{m}.output" in nan, "[4, 8]", micro))
        else:
            order = reversed(MODEL) if family == "grad_unreduced" else MODEL
            for m in order:
                lines.append(row(f"module.{m}.weight", step, f"{m}.weight" in nan, "[8, 8]", micro))
        head = MICRO if micro is not None else PLAIN
        f = self.dirs[rank] / (name or f"{family}_{step}-{step}.csv")
        if f.exists():
            head = ""  # the next micro-batch's rows, appended
        with f.open("a") as fh:
            fh.write(head + "".join(lines) + extra)

    def step(self, step: int, nan: dict[int, dict[str, set[str]]]) -> None:
        for rank in self.dirs:
            for family in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_updated"):
                self.write(rank, family, step, nan.get(rank, {}).get(family, set()))


ALL = {f"{m}.weight" for m in MODEL}


def scan(db: Path, *paths: Path) -> Pipeline:
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(p) for p in paths])
        pipe.scan()
        return pipe
    finally:
        store.close()


def the_incident(db: Path) -> dict[str, Any]:
    store = Store.open(db, readonly=True)
    try:
        incs = list_incidents(store._conn)
    finally:
        store.close()
    assert [i["kind"] for i in incs] == ["nan"], incs
    return incs[0]


def test_forward_birth_is_the_module_whose_inputs_are_finite(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 2)
    t.step(0, {})
    fwd = {"layers.1.output", "output_layer.input", "output_layer.output"}
    t.step(1, {r: {"actv": fwd, "grad_reduced": ALL} for r in (0, 1)})
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")
    o = inc["origin"]
    assert (o["rank"], o["step"], o["phase"], o["tag"], o["module"]) == (
        0,
        1,
        "forward",
        "actv",
        "layers.1",
    )
    assert o["tensor"] == "module.layers.1.output"
    assert "inside the forward of `layers.1`" in inc["detail"]["root_cause"]
    assert "ranks 1 show the same first phase" in " ".join(inc["detail"]["notes"])


def test_nan_from_the_loss(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 2)
    t.step(4, {1: {"actv_grad": {".output", "output_layer.output", "output_layer.input"}}})
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")
    o = inc["origin"]
    assert (o["rank"], o["step"], o["tag"], o["tensor"], o["module"]) == (
        1,
        4,
        "actv_grad",
        ".output",
        None,
    )
    assert "arrives from the loss" in inc["detail"]["root_cause"]


def test_birth_inside_a_backward_on_one_rank_of_four(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 4)
    t.step(6, {})
    up = {"layers.1.input", "layers.0.output", "layers.0.input", "embedding.output"}
    grads = {"layers.1.weight", "layers.0.weight", "embedding.weight"}
    nan = {r: {"grad_reduced": ALL, "param_updated": ALL} for r in range(4)}
    nan[3].update(actv_grad=up, grad_unreduced=grads)
    t.step(7, nan)
    t.step(8, {r: {"actv": {"embedding.output"}, "grad_reduced": ALL} for r in range(4)})
    (t.root / "stdout.log").write_text(
        "[train] iter 8 rank 3 loss: 0.52\n[train] iter 9 rank 3 loss: nan\n"
    )
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")
    o = inc["origin"]
    assert (o["rank"], o["step"], o["phase"], o["module"]) == (3, 7, "backward", "layers.1")
    assert (o["tag"], o["tensor"]) == ("actv_grad", "module.layers.1.input")
    assert o["first_param"] == {
        "tensor": "module.layers.1.weight",
        "tag": "grad_unreduced",
        "shape": [8, 8],
        "step": 7,
    }
    d = inc["detail"]
    assert "inside the backward of `layers.1`" in d["root_cause"]
    assert "gradient arriving at its output is finite" in d["root_cause"]
    assert any(n.startswith("ranks 0-2: unreduced gradients finite") for n in d["notes"])
    assert any(n.startswith("the training log shows it too") for n in d["notes"])
    followed = {(f["step"], f["tag"]): f["ranks"] for f in d["followed"]}
    assert followed[(7, "grad_unreduced")] == [3] and followed[(7, "grad_reduced")] == [0, 1, 2, 3]
    assert followed[(8, "actv")] == [0, 1, 2, 3]
    assert inc["ranks"] == [0, 1, 2, 3]


def test_an_empty_input_at_the_origin_is_noted_not_a_nan(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 2)
    t.step(11, {r: {"grad_reduced": {"embedding.weight"}} for r in (0, 1)})
    t.write(1, "grad_unreduced", 11, {"embedding.weight"})
    empty = (
        "0,module.dn_query_generator.label_embedding.input,11,0,"
        '0.0,nan,nan,nan,0,nan,"[0]",torch.int64\n'
    )
    t.write(1, "actv", 11, set(), extra=empty)
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")  # the empty tensor opens no incident of its own
    o = inc["origin"]
    assert (o["rank"], o["step"], o["tag"], o["module"]) == (1, 11, "grad_unreduced", "embedding")
    notes = " ".join(inc["detail"]["notes"])
    assert "empty tensors on rank 1 at step 11 of `dn_query_generator.label_embedding`" in notes
    conn = sqlite3.connect(tmp_path / "db")
    try:
        kinds = dict(conn.execute("SELECT kind, count(*) FROM events GROUP BY kind").fetchall())
    finally:
        conn.close()
    assert kinds["data_issue"] == 1


def test_micro_batches_in_execution_order(tmp_path: Path) -> None:
    """Gradient accumulation: forward/backward of micro-batch 0, then of micro-batch 1."""
    t = Tree(tmp_path / "run", 2)
    for rank in (0, 1):
        for micro in (0, 1):
            fwd = {"output_layer.output"} if rank == 0 and micro == 1 else set()
            bwd = {"layers.0.input", "embedding.output"} if rank == 1 and micro == 1 else set()
            t.write(rank, "actv", 4, fwd, micro=micro)
            t.write(rank, "actv_grad", 4, bwd, micro=micro)
            # monitor_mbs_grad: per-micro-batch unreduced gradients
            gu = {"layers.0.weight", "embedding.weight"} if rank == 1 and micro == 1 else set()
            t.write(rank, "grad_unreduced", 4, gu, micro=micro)
    scan(tmp_path / "db", t.root)
    o = the_incident(tmp_path / "db")["origin"]
    # rank 0's forward NaN and rank 1's backward NaN are both in micro-batch 1: forward first
    assert (o["rank"], o["micro_step"], o["phase"], o["module"]) == (
        0,
        1,
        "forward",
        "output_layer",
    )
    t2 = Tree(tmp_path / "run2", 2)
    t2.write(0, "actv", 4, {"output_layer.output"}, micro=1)
    t2.write(1, "actv_grad", 4, {"layers.0.input", "embedding.output"}, micro=0)
    scan(tmp_path / "db2", t2.root)
    o2 = the_incident(tmp_path / "db2")["origin"]
    # micro-batch 0's backward ran before micro-batch 1's forward
    assert (o2["rank"], o2["micro_step"], o2["module"]) == (1, 0, "layers.0")


def test_only_reduced_gradients_nan(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 2)
    t.step(2, {r: {"grad_reduced": {"layers.0.weight"}} for r in (0, 1)})
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")
    assert (inc["origin"]["phase"], inc["origin"]["tag"]) == ("reduce", "grad_reduced")
    assert "in the reduction" in inc["detail"]["root_cause"]


def test_without_activation_gradients_the_backward_order_decides(tmp_path: Path) -> None:
    t = Tree(tmp_path / "run", 1)
    t.write(0, "grad_unreduced", 5, {"layers.0.weight", "embedding.weight"})
    scan(tmp_path / "db", t.root)
    inc = the_incident(tmp_path / "db")
    assert (inc["origin"]["module"], inc["origin"]["tag"]) == ("layers.0", "grad_unreduced")
    assert (
        "gradients computed before it in this backward pass are finite"
        in inc["detail"]["root_cause"]
    )
    t2 = Tree(tmp_path / "run2", 1)
    t2.write(0, "grad_unreduced", 5, ALL)
    scan(tmp_path / "db2", t2.root)
    inc2 = the_incident(tmp_path / "db2")
    assert "arrives from the loss or is produced in" in inc2["detail"]["root_cause"]
    assert inc2["origin"]["module"] == "output_layer"


def test_dumps_alone_order_by_call_id(tmp_path: Path) -> None:
    d = tmp_path / "run" / "monitor_output" / "anomaly_detected" / "rank5"
    d.mkdir(parents=True)

    def entry(tag: str, call: int, hist: str = "0.1") -> tuple[str, dict[str, Any]]:
        msg = (
            f"Rule AnomalyNan reports anomaly signal in ('{tag}', 'mean') at step 9, "
            f"current value nan, history mean {hist}."
        )
        return f"{tag}_step_9_call_{call}", {
            "rank": 5,
            "step": 9,
            "call_id": call,
            "tag_name": tag,
            "message": msg,
        }

    data = dict(
        [
            entry("0:module.layers.0.output:0/rank5/actv_grad", 24),
            entry("0:module.layers.1.input:0/rank5/actv_grad", 20),
            entry("0:module.layers.0.input:0/rank5/actv_grad", 23),
            entry("0:module.embedding.input:0/rank5/actv_grad", 26, "nan"),
            entry("0:module.layers.1.weight/rank5/acc_grad", 21),
        ]
    )
    (d / "anomaly.json").write_text(json.dumps(data))
    scan(tmp_path / "db", tmp_path / "run")
    o = the_incident(tmp_path / "db")["origin"]
    assert (o["rank"], o["step"], o["tensor"], o["module"], o["call_id"]) == (
        5,
        9,
        "module.layers.1.input",
        "layers.1",
        20,
    )
    assert o["first_param"]["tensor"] == "module.layers.1.weight"


def test_text_nan_lines_alone_keep_the_earliest_line(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank2.log").write_text(
        "2026/11/30 10:00:05 - mmengine - INFO - Epoch(train)  [1][10/16]  lr: 1.0000e-04  "
        "eta: 0:00:10  time: 0.8612  data_time: 0.0123  memory: 21034  loss: nan\n"
    )
    scan(tmp_path / "db", tmp_path / "logs")
    o = the_incident(tmp_path / "db")["origin"]
    assert (o["rank"], o["epoch"], o["iter"], o["tensor"]) == (2, 1, 10, "loss")


# -- runs -----------------------------------------------------------------------------------------


def test_monitor_output_and_stdout_are_one_run_and_relaunches_split(tmp_path: Path) -> None:
    root = tmp_path / "job"
    first = Tree(root, 2, "Dec01_10-00-00")
    first.step(3, {0: {"grad_unreduced": {"embedding.weight"}, "grad_reduced": ALL}})
    # a relaunch seven minutes later writes new rank folders beside the old ones
    later = Tree(root, 2, "Dec01_10-07-00")
    later.step(1, {1: {"grad_unreduced": {"layers.0.weight"}, "grad_reduced": ALL}})
    log = root / "stdout.log"
    log.write_text("[train] iter 1 rank 0 loss: nan\n")
    # Times from the data, never from today: the folders were written into minutes after they
    # were named on 1 December 2026 (Asia/Shanghai, msprobe's zone), and the log was last
    # written between the two launches, so it is the first launch's.
    launch = 1796090400.0  # 2026-12-01 10:00:00 +08:00
    for tree, written in ((first, launch + 300), (later, launch + 900)):
        for d in tree.dirs.values():
            os.utime(d, (written, written))
    os.utime(log, (launch + 120, launch + 120))
    scan(tmp_path / "db", root)
    store = Store.open(tmp_path / "db", readonly=True)
    try:
        runs = [r["name"] for r in list_runs(store._conn)]
        incs = {i["run"]: i for i in list_incidents(store._conn)}
    finally:
        store.close()
    assert runs == ["job", "job/Dec01_10-07-00"]
    assert incs["job"]["origin"]["rank"] == 0 and incs["job"]["origin"]["step"] == 3
    assert incs["job/Dec01_10-07-00"]["origin"]["rank"] == 1
    conn = sqlite3.connect(tmp_path / "db")
    try:
        (run_of_log,) = conn.execute(
            "SELECT r.name FROM sources s JOIN runs r ON r.id = s.run_id "
            "WHERE s.path LIKE '%stdout.log'"
        ).fetchone()
    finally:
        conn.close()
    assert run_of_log == "job"


def test_a_rank_that_appears_twice_is_a_new_launch(tmp_path: Path) -> None:
    root = tmp_path / "job"
    Tree(root, 1, "Dec01_10-00-00").step(0, {0: {"grad_reduced": ALL}})
    Tree(root, 1, "Dec01_10-00-40").step(0, {0: {"grad_reduced": ALL}})  # restarted at once
    scan(tmp_path / "db", root)
    store = Store.open(tmp_path / "db", readonly=True)
    try:
        assert [r["name"] for r in list_runs(store._conn)] == ["job", "job/Dec01_10-00-40"]
    finally:
        store.close()
