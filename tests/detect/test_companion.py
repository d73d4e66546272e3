"""The daemon's side of the companion: records -> run facts, data issues, stages, OOM reports,
collective timeouts and the NaN story (project-written lines in the formats the probe prints)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.config import Config
from nanwatch.correlate.knowledge import Knowledge
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.detect import Detector, StreamState, companion, load_rules
from nanwatch.query import list_incidents, list_runs, show_incident
from nanwatch.render import render_story
from nanwatch.store import Store
from nanwatch.store.events import Events
from nanwatch.store.incidents import Incidents

from ..conftest import nanwatch

DETECTOR = Detector(load_rules(), default_year=2026)
GOLDEN = Path(__file__).parent.parent / "fixtures" / "companion_empty_gt_nan" / "work_dir"


def feed(text: str, state: StreamState | None = None) -> tuple[list[Any], list[dict[str, Any]]]:
    facts: list[dict[str, Any]] = []
    events, _ = DETECTOR.feed(text.encode(), 0, state or StreamState(), "x.log", facts=facts)
    return events, facts


def scan(tmp_path: Path, files: dict[str, str], config: Config | None = None) -> Store:
    root = tmp_path / "work_dir"
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    store = Store.open(tmp_path / "nw.db")
    Pipeline(config or Config(), store, [str(root)]).scan()
    return store


def test_records_behind_log_prefixes() -> None:
    lines = [
        '2026/11/30 10:15:30 - mmengine - INFO - NANWATCH-FACTS {"rank":0,"world_size":8}',
        '[rank3]: NANWATCH-DATA {"rank":3,"step":12,"image":"a.jpg","reason":"empty ground truth"}',
        '[default5]:NANWATCH-DATA {"step":13,"image":"b.jpg","reason":"empty ground truth"}',
    ]
    events, facts = feed("\n".join(lines) + "\n")
    assert facts == [{"rank": 0, "world_size": 8}]
    assert [(e.kind, e.rank, e.step, e.fields["image"]) for e in events] == [
        ("data_issue", 3, 12, "a.jpg"),
        ("data_issue", 5, 13, "b.jpg"),  # the launcher's prefix names the rank
    ]
    assert all(e.fields["incident"] is False for e in events)


@pytest.mark.parametrize(
    "line",
    [
        "NANWATCH-FACTS {not json}",
        "NANWATCH-FACTS [1, 2]",
        'NANWATCH-FACTS {"rank": 0',
        'NANWATCH-BOGUS {"rank": 0}',
        'see NANWATCH-DATA {"rank": 1} for details, said nobody',
    ],
)
def test_records_that_do_not_parse_are_ignored(line: str) -> None:
    assert feed(line + "\n") == ([], [])


def test_a_huge_line_is_no_record() -> None:
    line = "NANWATCH-DATA {" + '"image": "x", ' * 20000 + '"reason": "empty ground truth"}'
    assert feed(line + "\n") == ([], [])
    hostile = "NANWATCH-DATA {}" * 50000 + " tail"
    assert feed(hostile + "\n") == ([], [])


def test_facts_from_a_log_are_checked() -> None:
    hostile = {
        "rank": -1,
        "world_size": "8x",
        "local_rank": True,
        "node": ["n"],
        "work_dir": "w" * 5000,
        "versions": {"torch": "2.1.0", "cann": None, "evil": {"nested": 1}, "": "x"},
        "timeouts": {"HCCL_EXEC_TIMEOUT": "3600", "NCCL_TIMEOUT": float("nan"), "pg": 1800},
        "job": "not a table",
        "pid": 12,
        "unknown": 1,
    }
    events, facts = feed("NANWATCH-FACTS " + json.dumps(hostile) + "\n")
    assert events == []
    assert facts == [
        {"work_dir": "w" * 1000, "versions": {"torch": "2.1.0"}, "timeouts": {"pg": 1800}}
    ]


def test_a_stream_announced_by_one_rank_is_that_ranks() -> None:
    st = StreamState()
    events, _ = feed(
        'NANWATCH-FACTS {"rank":6,"device":{"type":"npu"}}\n'
        "RuntimeError: NPU out of memory. Tried to allocate 2.25 GiB\n",
        st,
    )
    assert [(e.kind, e.rank, e.device) for e in events] == [("oom", 6, "npu")]
    # a second rank announcing itself in the same stream: it is shared, no rank is assumed
    events, _ = feed('NANWATCH-FACTS {"rank":7}\nRuntimeError: CUDA error: out of memory\n', st)
    assert st.rank is None and st.announced == -1
    feed('NANWATCH-FACTS {"rank":5}\n', st)
    assert st.rank is None


def test_stage_markers_set_the_stage_of_a_failure_without_iteration_lines() -> None:
    text = (
        'NANWATCH-STAGE {"t":1796033940.0,"rank":2,"stage":"val","event":"start","epoch":3}\n'
        "Traceback (most recent call last):\n"
        '  File "tools/train.py", line 121, in <module>\n'
        "RuntimeError: NPU out of memory. Tried to allocate 2.25 GiB (NPU 2; 60.96 GiB total "
        "capacity; 57.10 GiB already allocated; 57.10 GiB current active; 1.02 GiB free; 58.39 GiB "
        "reserved in total by PyTorch)\n"
        'NANWATCH-MEMORY {"t":1796033941.2,"rank":2,"stage":"val","exception":"RuntimeError: NPU '
        'out of memory. Tried to allocate 2.25 GiB","oom":true,"device":"npu","device_index":2,'
        '"allocated":61312548864,"reserved":62696013824,"peak_allocated":62000000000,'
        '"inactive_split":1383464960,"alloc_retries":3,"ooms":1}\n'
    )
    events, _ = feed(text)
    assert len(events) == 1  # the traceback and the summary are one report
    ev = events[0]
    assert (ev.kind, ev.stage, ev.rank) == ("oom", "val", 2)
    assert ev.fields["rule"] != "companion.oom"  # the traceback's line gives kind and message
    assert ev.fields["peak_allocated"] == 62000000000 and ev.fields["alloc_retries"] == 3
    assert ev.fields["stream_time"] == "2026-11-30T10:19:00.000Z"  # from the stage marker
    # validation over: training again
    st = StreamState(stage="val")
    feed('NANWATCH-STAGE {"stage":"val","event":"end"}\n', st)
    assert st.stage == "train"


def test_a_memory_summary_alone() -> None:
    line = (
        'NANWATCH-MEMORY {"rank":1,"stage":"train","exception":"OutOfMemoryError: CUDA out of '
        'memory.","oom":true,"device":"cuda","allocated":1024}\n'
    )
    events, _ = feed(line)
    assert [(e.kind, e.rank, e.device, e.fields["allocated"]) for e in events] == [
        ("oom", 1, "cuda", 1024)
    ]
    # after any other exception the summary is context, not a detection
    assert feed(line.replace('"oom":true', '"oom":false'))[0] == []


def test_run_facts_from_every_rank_keep_rank_zeros_identity(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "golden.db")
    try:
        Pipeline(Config(), store, [str(GOLDEN)]).scan()
        (run,) = list_runs(store._conn)
        f = run["facts"]
        assert (f["rank"], f["local_rank"], f["node"], f["world_size"]) == (0, 0, "node-0", 8)
        assert f["versions"]["cann"] == "7.0.0" and f["versions"]["torchvision"] == "0.16.0"
        assert f["job"]["slurm_job_id"] == "73105"
        assert f["timeouts"] == {
            "HCCL_EXEC_TIMEOUT": 3600,
            "HCCL_CONNECT_TIMEOUT": 3600,
            "pg_timeout": 1800,
        }
        assert f["backend"] == "hccl" and f["launcher"] == "pytorch"
        # the knowledge base says which CANN the run printed
        (inc,) = list_incidents(store._conn)
        run_row = Incidents(store).run(run["id"])
        hints = Knowledge.load().hints_for(
            Events(store),
            inc["id"],
            "nan",
            {"tensor": "module.dn_query_generator.label_embedding.weight"},
            {},
            run_row,
        )
        cann = next(h for h in hints if h["id"] == "nan-embedding-empty-input-cann")
        assert "cann 7.0.0 (printed by the run) is <8.0.0" in cann["text"]
        # the NaN story names the samples
        text = render_story(show_incident(store._conn, inc["id"]) or {})
        assert "rank 6, epoch 3, iter 137: data/new/train/000000001022.jpg (image_id 1022)" in text
        assert "000000000913.jpg" not in text  # long before the NaN
    finally:
        store.close()


OOM_RANK2 = (
    "{facts}\n"
    'NANWATCH-STAGE {{"t":1796033940.0,"rank":2,"stage":"val","event":"start","epoch":3}}\n'
    "Traceback (most recent call last):\n"
    '  File "/usr/local/python3.9/site-packages/mmengine/runner/loops.py", line 373, in run\n'
    "RuntimeError: NPU out of memory. Tried to allocate 2.25 GiB (NPU 2; 60.96 GiB total capacity;"
    " 57.10 GiB already allocated; 57.10 GiB current active; 1.02 GiB free; 58.39 GiB reserved in "
    "total by PyTorch)\n"
)
# 51 minutes after the OOM; the line does not name the rank it waited for
TIMEOUT_RANK0 = (
    "[ERROR] 2026-11-30-11:10:02 (PID:40100, Device:0, RankID:0) ERR01100 OPS call acl api "
    "failed.\n"
    "EI0002: [PID: 40100] 2026-11-30-11:10:02.551.120 The wait execution of the Notify register "
    "times out. Reason: The Notify register has not received the Notify record. base "
    "information: [streamID:[4], taskID[1123], taskType[Notify Wait], "
    "tag[Broadcast_group_name_hccl_world_group]\n"
)


@pytest.mark.parametrize(
    ("exec_timeout", "incidents"), [(3600, ["oom"]), (None, ["oom", "comm_timeout"])]
)
def test_collective_timeouts_from_the_runs_facts(
    tmp_path: Path, exec_timeout: int | None, incidents: list[str]
) -> None:
    told: dict[str, Any] = {"rank": 2, "world_size": 4}
    if exec_timeout:
        told["timeouts"] = {"HCCL_EXEC_TIMEOUT": exec_timeout}
    files = {
        "20261130_101500/rank2.log": OOM_RANK2.format(facts="NANWATCH-FACTS " + json.dumps(told)),
        "20261130_101500/rank0.log": TIMEOUT_RANK0,
    }
    store = scan(tmp_path, files)
    try:
        got = [(i["kind"], i["origin"].get("stage")) for i in list_incidents(store._conn)]
        assert [k for k, _ in got] == incidents
        assert got[0] == ("oom", "val")
    finally:
        store.close()


def test_samples_far_from_the_nan_are_not_its_known_cause(tmp_path: Path) -> None:
    src = GOLDEN / "20261130_101500"
    rank6 = (src / "rank6.stderr.log").read_text().splitlines()
    rank0 = (src / "20261130_101500.log").read_text().splitlines(keepends=True)
    files = {
        "20261130_101500/20261130_101500.log": "".join(
            x for x in rank0 if "NANWATCH-DATA" not in x
        ),
        # only the sample of iteration 20, long before the last finite iteration (100)
        "20261130_101500/rank6.stderr.log": "\n".join(rank6[:2]) + "\n",
    }
    store = scan(tmp_path, files)
    try:
        (inc,) = list_incidents(store._conn)
        assert "related_data_issues" not in inc["detail"]
        assert "empty-gt-samples-seen" not in [h["id"] for h in inc["hints"]]
    finally:
        store.close()


def test_config_timeouts_still_win(tmp_path: Path) -> None:
    told = {"rank": 2, "timeouts": {"HCCL_EXEC_TIMEOUT": 3600}}
    files = {
        "20261130_101500/rank2.log": OOM_RANK2.format(facts="NANWATCH-FACTS " + json.dumps(told)),
        "20261130_101500/rank0.log": TIMEOUT_RANK0,
    }
    cfg = Config()
    cfg = dataclasses.replace(
        cfg, knowledge=dataclasses.replace(cfg.knowledge, hccl_exec_timeout=600.0)
    )
    store = scan(tmp_path, files, cfg)
    try:
        assert [i["kind"] for i in list_incidents(store._conn)] == ["oom", "comm_timeout"]
    finally:
        store.close()


def test_samples_read_after_the_nan_join_its_story(tmp_path: Path) -> None:
    """Rank 6's stderr arrives after rank 0's log has opened the NaN incident."""
    work = tmp_path / "work_dir" / "20261130_101500"
    work.mkdir(parents=True)
    src = GOLDEN / "20261130_101500"
    (work / "20261130_101500.log").write_text((src / "20261130_101500.log").read_text())
    store = Store.open(tmp_path / "nw.db")
    try:
        pipe = Pipeline(Config(), store, [str(tmp_path / "work_dir")], live=True)
        pipe.step()
        (inc,) = list_incidents(store._conn)
        assert [d["rank"] for d in inc["detail"]["related_data_issues"]] == [0]
        (work / "rank6.stderr.log").write_text((src / "rank6.stderr.log").read_text())
        pipe.step()
        (inc,) = list_incidents(store._conn)
        related = inc["detail"]["related_data_issues"]
        assert [(d["rank"], d["iter"]) for d in related] == [(0, 140), (6, 137), (6, 137), (6, 137)]
        pipe.tracker.close()
    finally:
        store.close()


def test_explain_shows_the_facts_a_line_tells() -> None:
    out = nanwatch("explain", "    dist_cfg: {'backend': 'nccl', 'timeout': 7200}").stdout
    assert "run fact: backend = 'nccl'" in out
    assert "run fact: timeouts.pg_timeout = 7200" in out
    data = json.loads(
        nanwatch("explain", "--json", 'NANWATCH-FACTS {"rank":0,"world_size":2}').stdout
    )
    assert data["facts"] == {"rank": 0, "world_size": 2}


def test_line_starts_find_every_record() -> None:
    chunk = b"a\nx NANWATCH-DATA {}\nb\nNANWATCH-FACTS {} NANWATCH-FACTS {}\nc"
    assert companion.line_starts(chunk) == {2, 23}


def test_show_says_the_cann_version_is_unknown_and_how_to_find_it(tmp_path: Path) -> None:
    """A job without torch_npu loaded says so in its facts; `show` passes it on."""
    from nanwatch.integrations.probe_facts import collect_facts

    facts = collect_facts(environ={"RANK": "6", "WORLD_SIZE": "8"})
    assert "cann" not in facts["versions"]
    log = tmp_path / "run" / "rank6.log"
    log.parent.mkdir()
    log.write_text(
        "NANWATCH-FACTS " + json.dumps({"v": 1, "t": 1796033730.0, **facts}) + "\n"
        "2026-11-30 10:20:41 (4411) [rank 6] [INFO] > Rule AnomalyNan reports anomaly signal in "
        "('0:module.dn_query_generator.label_embedding.weight/rank6/pre_grad', 'norm') at step "
        "1520.\n",
        encoding="utf-8",
    )
    db = tmp_path / "db.sqlite"
    res = CliRunner().invoke(cli, ["scan", "--db", str(db), str(log.parent)])
    assert res.exit_code == 0, res.output
    store = Store.open(db, readonly=True)
    try:
        (run,) = list_runs(store._conn)
        assert run["facts"]["unknown"]["cann"] == "torch_npu is not imported by the job"
        (inc,) = list_incidents(store._conn)
    finally:
        store.close()
    res = CliRunner().invoke(cli, ["show", "--db", str(db), str(inc["id"])])
    assert res.exit_code == 0, res.output
    assert (
        "CANN version unknown (torch_npu is not imported by the job): run "
        "`cat $ASCEND_TOOLKIT_HOME/version.cfg`"
    ) in " ".join(res.output.split())
