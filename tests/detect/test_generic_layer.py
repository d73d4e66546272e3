"""The generic layer under the rule packs: tracebacks read as records, vendor error codes that
join the failure report they belong to, any non-finite metric, host OOM kills that explain the
ranks they killed, and quiet healthy logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.demo.simulate import TrainingRun
from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.errors import RuleError
from nanwatch.events import Event

DETECTOR = Detector(load_rules(), default_year=2026)
FIXTURES = Path(__file__).parent.parent / "fixtures"


def feed(lines: list[str], state: StreamState | None = None) -> list[Event]:
    st = state if state is not None else StreamState()
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    events, _ = DETECTOR.feed(data, 0, st, "rank.log")
    return events


def frames(prefix: str = "", n: int = 2) -> list[str]:
    out = []
    for i in range(n):
        out += [f'{prefix}  File "/work/train.py", line {10 + i}, in step', f"{prefix}    run()"]
    return out


def test_a_traceback_that_ends_a_rank_is_a_process_failure_with_its_exception() -> None:
    events = feed(["Traceback (most recent call last):", *frames(), "KeyError: 'image_id'"])
    assert [(e.kind, e.fields.get("exception"), e.fields.get("reason")) for e in events] == [
        ("process_failure", "KeyError", "'image_id'")
    ]
    assert events[0].line == 6  # the final line: the header is context, not an event


def test_interleaved_tracebacks_of_two_ranks_are_two_records() -> None:
    lines = [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        *frames("[rank0]: "),
        *frames("[rank1]: "),
        "[rank1]: AssertionError: shapes differ",
        "[rank0]: ValueError: empty batch",
    ]
    got = sorted((e.rank, e.fields["exception"]) for e in feed(lines))
    assert got == [(0, "ValueError"), (1, "AssertionError")]


def test_an_exception_line_outside_a_traceback_or_of_another_rank_is_not_a_failure() -> None:
    assert feed(["ValueError: bad row 12 skipped"]) == []
    # the record is rank 0's: rank 1's exception line alone ends nothing
    assert feed(["[rank0]: Traceback (most recent call last):", "[rank1]: ValueError: x"]) == []


def test_an_iteration_line_or_a_specific_detection_closes_the_record() -> None:
    lines = [
        "Traceback (most recent call last):",
        *frames(),
        "2026-03-02 10:00:00 | INFO | step 120 | loss: 2.31 | lr: 1e-4",
        "ValueError: printed later by something else",
    ]
    assert feed(lines) == []
    # an OOM line claimed by its own rule closes the record: the message's next line that looks
    # like an exception ("ncclUnhandledCudaError: ...") is not a second failure
    lines = [
        "Traceback (most recent call last):",
        *frames(),
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
        "ncclUnhandledCudaError: Call to CUDA function failed.",
    ]
    assert [e.kind for e in feed(lines)] == ["comm_error"]


def test_a_record_split_over_chunks_survives_the_state_round_trip() -> None:
    state = StreamState()
    assert feed(["[rank2]: Traceback (most recent call last):", *frames("[rank2]: ")], state) == []
    state = StreamState.from_json(state.to_json())
    events = feed(["[rank2]: RuntimeError: shape mismatch in expert 7"], state)
    assert [(e.kind, e.rank) for e in events] == [("process_failure", 2)]
    assert StreamState.from_json(state.to_json()).records is None  # closed by its final line


def test_a_record_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanwatch.detect import records

    monkeypatch.setattr(records, "RECORD_LINES", 5)
    lines = ["Traceback (most recent call last):", *frames(n=3), "ValueError: too late"]
    assert feed(lines) == []


def test_a_vendor_code_joins_the_report_of_the_specific_line_after_it() -> None:
    # torch_npu's generic ERR line first, then the HCCL code that says what failed
    lines = [
        "[ERROR] 2026-03-02-10:01:02 (PID:4242, Device:5, RankID:5) ERR00100 PTA call acl api "
        "failed",
        "EI0002: [PID: 4242] 2026-03-02-10:01:02.444.436 The wait execution of the Notify "
        "register times out. Reason: The Notify register has not received the Notify record "
        "from remote rank: [6].",
    ]
    events = feed(lines)
    assert [(e.kind, e.rank, e.fields.get("code")) for e in events] == [
        ("comm_timeout", 5, "EI0002")
    ]
    # and a generic RuntimeError after an NCCL error is part of that error's report
    lines = [
        "Traceback (most recent call last):",
        *frames(),
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
        "remote process exited or there was a network error, NCCL version 2.20.5",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        *frames(),
        "RuntimeError: training step failed",
    ]
    assert [e.kind for e in feed(lines)] == ["comm_error"]


def test_a_nan_report_does_not_swallow_a_crash() -> None:
    lines = [
        "2026-03-02 10:00:00 | INFO | step 120 | loss: 2.31 | acc: nan",
        "Traceback (most recent call last):",
        *frames(),
        "ValueError: metric buffer overflow",
    ]
    assert [e.kind for e in feed(lines)] == ["nan", "process_failure"]


def test_records_are_declared_on_the_right_rule_types(tmp_path: Path) -> None:
    pack = tmp_path / "site"
    pack.mkdir()
    (pack / "bad.toml").write_text(
        '[pack]\nid = "site"\n[[rule]]\nid = "site.x"\nkind = "nan"\nliterals = ["x"]\n'
        "pattern = 'x'\nopens = \"traceback\"\n",
        encoding="utf-8",
    )
    with pytest.raises(RuleError, match=r"site\.x.*`opens` is only for context rules"):
        load_rules([pack])
    (pack / "bad.toml").write_text(
        '[pack]\nid = "site"\n[[rule]]\nid = "site.x"\nkind = "nan"\nliterals = ["x"]\n'
        "pattern = 'x'\nwithin = \"a traceback\"\n",
        encoding="utf-8",
    )
    with pytest.raises(RuleError, match="within must name a record"):
        load_rules([pack])


def _scan(tmp_path: Path, *paths: Path) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    db = tmp_path / "scan.db"
    r = CliRunner().invoke(cli, ["scan", "--db", str(db), *map(str, paths)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["incidents", "--db", str(db), "--json"])
    incidents = [json.loads(x) for x in r.output.splitlines() if x.strip()]
    r = CliRunner().invoke(cli, ["events", "--db", str(db), "--json"])
    events = [json.loads(x) for x in r.output.splitlines() if x.strip()]
    return incidents, events


def test_a_host_oom_kill_and_the_rank_it_killed_are_one_oom_incident(tmp_path: Path) -> None:
    run = tmp_path / "job"
    run.mkdir()
    (run / "train.log").write_text(
        "2026-12-01 10:10:10,000 - INFO - step 110 | loss: 2.30\n"
        "E1201 10:10:36.620000 2606 site-packages/torch/distributed/elastic/multiprocessing/"
        "api.py:869] failed (exitcode: -9) local_rank: 5 (pid: 2630) of binary: /usr/bin/python\n",
        encoding="utf-8",
    )
    (run / "kern.log").write_text(
        "Dec 01 10:10:34 gpu-node-3 kernel: [81234.551020] Memory cgroup out of memory: Killed "
        "process 2630 (python) total-vm:98123400kB, anon-rss:61200300kB, file-rss:10240kB, "
        "shmem-rss:2048kB, UID:1000 pgtables:140000kB oom_score_adj:0\n",
        encoding="utf-8",
    )
    incidents, events = _scan(tmp_path, run)
    assert sorted(e["kind"] for e in events) == ["oom", "process_failure"]
    oom = next(e for e in events if e["kind"] == "oom")
    assert oom["device"] == "cpu" and oom["fields"]["memory"] == "host"
    assert [(i["kind"], i["event_count"]) for i in incidents] == [("oom", 2)]


def test_a_run_that_dies_of_an_unnamed_error_is_an_incident(tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "work_dirs" / "exp", ranks=2, nan_rank=None, nan_at=None)
    run.write()
    log = sorted(run.work_dir.rglob("*.log"))[0]
    with log.open("a", encoding="utf-8") as fh:
        fh.write("Traceback (most recent call last):\n")
        fh.write('  File "/work/tools/train.py", line 88, in <module>\n    main()\n')
        fh.write("jinja2.exceptions.UndefinedError: 'dict object' has no attribute 'pipeline'\n")
    incidents, events = _scan(tmp_path, run.work_dir)
    assert [i["kind"] for i in incidents] == ["process_failure"]
    assert [e["fields"]["exception"] for e in events] == ["jinja2.exceptions.UndefinedError"]


CUT = [
    "step 4120 | loss: 1.982 | lr: 2.0e-05",
    "[rank6]: Traceback (most recent call last):",
    '[rank6]:   File "/srv/job/pretrain.py", line 301, in <module>',
    "[rank6]:     main()",
    '[rank6]:   File "/srv/job/loop.py", line 77, in train_step',
    "[rank6]:     out = self.model(batch)",
    '[rank6]:   File "/srv/job/blocks.py", line 19, in forward',
]


def test_a_traceback_the_log_ends_inside_is_a_failure_at_its_innermost_frame(
    tmp_path: Path,
) -> None:
    """The final line never came (the process died printing it, or the log was cut): the
    scan reads the text to its end and reports the record of the rank that printed it, with
    the stage its frames tell; scanning again adds nothing."""
    log = tmp_path / "job" / "rank6.log"
    log.parent.mkdir()
    log.write_text("\n".join(CUT) + "\n")
    incidents, events = _scan(tmp_path, log.parent)
    assert [i["kind"] for i in incidents] == ["process_failure"]
    (ev,) = events
    assert (ev["rank"], ev["stage"], ev["line"], ev["step"]) == (6, "train", 2, 4120)
    assert "forward (blocks.py:19)" in ev["message"]
    again, events = _scan(tmp_path, log.parent)
    assert len(events) == 1 and len(again) == 1


def test_a_traceback_followed_by_training_or_its_final_line_is_not_cut(tmp_path: Path) -> None:
    """The run went on (an iteration line after it), or the final line came: nothing, or the
    failure of its own final line only."""
    went_on = tmp_path / "a" / "rank6.log"
    went_on.parent.mkdir()
    went_on.write_text("\n".join([*CUT, "step 4121 | loss: 1.975 | lr: 2.0e-05"]) + "\n")
    assert _scan(tmp_path, went_on.parent) == ([], [])
    ended = tmp_path / "b" / "rank6.log"
    ended.parent.mkdir()
    ended.write_text(
        "\n".join([*CUT, "[rank6]:     return F.linear(x)", "[rank6]: ValueError: bad"])
    )
    _, events = _scan(tmp_path / "b", ended.parent)
    assert [(e["kind"], e["fields"].get("exception")) for e in events] == [
        ("process_failure", "ValueError")
    ]


def test_healthy_simulated_runs_and_fixtures_stay_quiet() -> None:
    """Nothing the generic layer reads in logs that hold no failure of its kind."""
    generic = ("generic.", "host.", "scheduler.")
    paths = [p for p in FIXTURES.rglob("*") if p.is_file() and p.suffix != ".json"]
    for path in paths:
        events, _ = DETECTOR.feed(path.read_bytes(), 0, StreamState(), str(path))
        noisy = [e.message for e in events if str(e.fields.get("rule", "")).startswith(generic)]
        assert not noisy, f"{path}: {noisy[:3]}"


def test_healthy_simulated_training_gives_nothing(tmp_path: Path) -> None:
    run = TrainingRun(tmp_path / "wd" / "exp", ranks=2, nan_rank=None, nan_at=None)
    run.write()
    for log in run.work_dir.rglob("*"):
        if log.is_file():
            events, _ = DETECTOR.feed(log.read_bytes(), 0, StreamState(), str(log))
            assert events == [], (log, [e.message for e in events[:3]])


def test_a_scheduler_kill_is_a_failure_with_its_reason(tmp_path: Path) -> None:
    run = tmp_path / "slurm-4410"
    run.mkdir()
    (run / "slurm-4410.out").write_text(
        "2026-12-01 10:10:10,000 - INFO - step 110 | loss: 2.30\n"
        "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
        "slurmstepd: error: *** JOB 4410 ON gpu-a17 CANCELLED AT 2026-12-01T10:20:00 DUE TO "
        "TIME LIMIT ***\n"
        "slurmstepd: error: *** STEP 4410.0 ON gpu-a17 CANCELLED AT 2026-12-01T10:20:00 DUE TO "
        "TIME LIMIT ***\n",
        encoding="utf-8",
    )
    incidents, events = _scan(tmp_path, run)
    assert [(e["kind"], e["fields"]["reason"]) for e in events] == [
        ("process_failure", "TIME LIMIT")
    ]
    assert [i["kind"] for i in incidents] == ["process_failure"]


# --- mixed-precision overflow notices while the loss stays finite --------------------------------


@pytest.mark.parametrize(
    ("line", "scale"),
    [
        (
            "2026-03-04 11:02:13,551 [WARNING] overflow, still update, loss scale adjust to 2048.0",
            2048.0,
        ),
        (
            "2026-03-04 11:02:20,002 - mindformers[mindformers/core/callback/callback.py:512] - "
            "INFO - { Epoch:[  2/  5], step:[  130/  800], loss: 2.918, per_step_time: 733ms, "
            "lr: 3e-05, overflow cond: True, loss_scale: 4096.0, global_norm: [1.72]",
            4096.0,
        ),
        ("epoch: 3 step: 75, loss is 1.842, overflow is True, loss scale is 512.0", 512.0),
        ("step: 460 | loss: 2.05 | is_overflow: True | loss_scale: 128.0", 128.0),
        ("iteration 812 | loss 3.1 | overflow: True | scale: 1024", 1024.0),
        ("[2026-03-04 11:03:00] loss scale reduced from 8192.0 to 4096.0", 4096.0),
        ("[WARNING] iteration 77: found overflow, skip this step (loss scale 1024)", 1024.0),
        (
            "epoch: 4 step: 9, loss is (Tensor(shape=[], dtype=Float32, value= 2.04), "
            "Tensor(shape=[], dtype=Bool, value= True), Tensor(shape=[], dtype=Float32, "
            "value= 8192))",
            8192.0,
        ),
    ],
)
def test_overflow_notices_with_a_finite_loss_are_overflow_events(
    line: str, scale: float | None
) -> None:
    events = feed([line])
    assert [e.kind for e in events] == ["overflow"], line
    assert events[0].fields.get("loss_scale") == scale
    assert events[0].fields.get("incident") is False  # one skipped step opens nothing


@pytest.mark.parametrize(
    "line",
    [
        "epoch: 3 step: 76, loss is 1.833, overflow is False, loss scale is 512.0",
        "step: 461 | loss: 2.04 | is_overflow: False | loss_scale: 128.0",
        "{ Epoch:[  2/  5], step:[  131/  800], loss: 2.910, overflow cond: False, "
        "loss_scale: 4096.0 }",
        "loss scale: 65536.0 | grad norm: 0.81",
        "loss scale window set to 1000, loss scale reduced by a factor of 2 on overflow",
        "check_overflow: True, overflow: True",
        "epoch: 4 step: 10, loss is (Tensor(shape=[], dtype=Float32, value= 2.01), "
        "Tensor(shape=[], dtype=Bool, value= False), Tensor(shape=[], dtype=Float32, value= 8192))",
    ],
)
def test_overflow_columns_that_say_false_and_prose_stay_quiet(line: str) -> None:
    assert feed([line]) == []


# --- a skipped-step counter that grows ----------------------------------------------------------


def _ds(step: int, skipped: int, rank: int = 0) -> str:
    return (
        f"[2026-03-04 11:00:{step % 60:02d},100] [INFO] [logging.py:128:log_dist] [Rank {rank}] "
        f"step={step}, skipped={skipped}, lr=[2.9e-05], mom=[(0.9, 0.95)]"
    )


def test_a_skipped_step_counter_that_grows_is_an_overflow() -> None:
    st = StreamState()
    assert feed([_ds(10, 0), _ds(20, 0)], st) == []
    events = feed([_ds(30, 2), _ds(40, 2), _ds(50, 3)], st)
    assert [(e.kind, e.step, e.fields["skipped"], e.fields["new_skipped"]) for e in events] == [
        ("overflow", 30, 2, 2),
        ("overflow", 50, 3, 1),
    ]
    # the state carries the counter across chunks and restarts
    st = StreamState.from_json(st.to_json())
    assert feed([_ds(60, 3)], st) == []
    assert [e.fields["skipped"] for e in feed([_ds(70, 4)], st)] == [4]


def test_a_skipped_steps_key_counts_the_same_way() -> None:
    lines = [
        f"global_step: {n * 100} | skipped_steps: {k} | loss: 2.1"
        for n, k in enumerate([0, 0, 1, 1, 4])
    ]
    assert [e.fields["new_skipped"] for e in feed(lines)] == [1, 3]


def test_the_first_sight_of_skipped_steps_is_an_overflow_and_each_rank_counts_alone() -> None:
    events = feed([_ds(100, 5, rank=0), _ds(100, 5, rank=1), _ds(110, 5, rank=0)])
    assert [(e.rank, e.fields["skipped"]) for e in events] == [(0, 5), (1, 5)]


# --- a watchdog that ends a rank because of a device or kernel error ------------------------------


def test_an_hccl_watchdog_ended_by_a_device_error_is_a_comm_event() -> None:
    lines = [
        "[rank2]:[E1201 09:14:33.512208930 ProcessGroupHCCL.cpp:1603] [PG 0 Rank 2] HCCL watchdog "
        "thread terminated with exception: The Inner error is reported as above. The process "
        "exits for this inner error, and the current working operator name is MatMulV2.",
        "[rank2]: [ERROR] 2026-12-01-09:14:33 (PID:4121, Device:2, RankID:2) ERR00100 PTA call "
        "acl api failed",
        "[rank2]: EH9999: Inner Error!",
    ]
    events = feed(lines)
    assert [(e.kind, e.rank, e.fields.get("backend")) for e in events] == [
        ("comm_error", 2, "hccl")
    ]


@pytest.mark.parametrize(
    "what",
    [
        "[Rank 5] HCCL watchdog thread terminated with exception: ACL stream synchronize failed, "
        "error code:507014",
        "[PG ID 1 PG GUID 3 Rank 5] Process group watchdog thread terminated with exception: "
        "aicore execution is timeout, error code is 507035",
        "[Rank 5] HCCL watchdog thread terminated with exception: NPU function error: "
        "c10_npu::acl::AclrtSynchronizeStreamWithTimeout(stream), error code is 507035",
        "[Rank 5] Watchdog caught collective operation timeout: WorkHCCL(SeqNum=41, "
        "OpType=ALLGATHER, TensorShape=[4096], Timeout(ms)=1800000) ran for 1800512 milliseconds "
        "before timing out.",
        "[Rank 5] Caught collective operation timeout: WorkNCCL(OpType=BROADCAST, "
        "TensorShape=[1], Timeout(ms)=600000) ran for 600312 milliseconds before timing out.",
    ],
)
def test_watchdog_wordings_are_comm_events_of_their_rank(what: str) -> None:
    events = feed(
        ["terminate called after throwing an instance of 'c10::Error'", f"  what():  {what}"]
    )
    assert [(e.kind[:5], e.rank) for e in events] == [("comm_", 5)], what


def test_a_watchdog_timeout_or_device_error_is_told_by_its_code_not_an_api_name() -> None:
    def kind(what: str) -> str:
        return feed([f"[Rank 1] HCCL watchdog thread terminated with exception: {what}"])[0].kind

    assert kind("aicore execution is timeout, error code is 507014") == "comm_timeout"
    assert kind("AclrtSynchronizeStreamWithTimeout(stream), error code is 507035") == "comm_error"
    assert kind("The Inner error is reported as above.") == "comm_error"


def test_a_watchdog_stack_without_its_message_is_a_comm_error() -> None:
    lines = [
        "Exception raised from hcclCommWatchdog at /usr1/torch_npu/csrc/distributed/"
        "ProcessGroupHCCL.cpp:1201 (most recent call first):",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x5d (0xffff8a1b2c3d in "
        "/usr/local/lib/python3.9/site-packages/torch/lib/libc10.so)",
    ]
    assert [(e.kind, e.fields.get("backend")) for e in feed(lines)] == [("comm_error", "hccl")]


def test_the_exit_after_a_watchdog_error_is_its_effect(tmp_path: Path) -> None:
    run = tmp_path / "job"
    run.mkdir()
    (run / "rank2.log").write_text(
        "[rank2]:[E1201 09:14:33.512208930 ProcessGroupHCCL.cpp:1603] [PG 0 Rank 2] HCCL watchdog "
        "thread terminated with exception: ACL stream synchronize failed, error code:507014\n"
        "E1201 09:14:41.002000 140012 torch/distributed/elastic/multiprocessing/api.py:869] failed "
        "(exitcode: -6) local_rank: 2 (pid: 4121) of binary: /usr/bin/python3\n",
        encoding="utf-8",
    )
    incidents, events = _scan(tmp_path, run)
    # an AICore execution timeout: the operator the watchdog waited for hung
    assert sorted(e["kind"] for e in events) == ["comm_timeout", "process_failure"]
    assert [(i["kind"], i["event_count"]) for i in incidents] == [("comm_timeout", 2)]


# --- rank fields from the record's own lines ------------------------------------------------------


def test_an_ascend_report_takes_the_rank_its_own_lines_name() -> None:
    ei0002 = (
        "EI0002: [PID: {pid}] 2026-12-01-10:01:0{s}.115.321 The wait execution of the Notify "
        "register times out. Reason: The Notify register has not received the Notify record from "
        "remote rank [0]."
    )
    lines = [
        "[ERROR] 2026-12-01-10:01:02 (PID:3301, Device:1, RankID:1) ERR00100 PTA call acl api "
        "failed",
        ei0002.format(pid=3301, s=2),
        "[ERROR] 2026-12-01-10:01:03 (PID:3305, Device:5, RankID:-1) ERR00100 PTA call acl api "
        "failed",
        ei0002.format(pid=3305, s=3),
        "        rank 5 of hccl_world_group waits for the notify of rank 0",
        "2026-12-01 10:01:04.300 [rank 7] ERR00100 PTA call acl api failed",
        ei0002.format(pid=3307, s=4),
    ]
    events = feed(lines)
    assert [(e.kind, e.rank, e.fields.get("remote_rank")) for e in events] == [
        ("comm_timeout", 1, 0),
        ("comm_timeout", 5, 0),
        ("comm_timeout", 7, 0),
    ]
    # a report of another process (its own PID) right after one of rank 1 is not rank 1's
    events = feed([*lines[:2], ei0002.format(pid=3309, s=5)])
    assert [(e.rank, e.fields.get("reporter_pid")) for e in events] == [(1, 3301), (None, 3309)]


def _torchrun_head(nnodes: int, group_rank: int | None) -> list[str]:
    lines = [
        "I1201 08:00:00.100000 9001 torch/distributed/launcher/api.py:188] Starting "
        "elastic_operator with launch configs:\n  entrypoint       : train.py\n"
        f"  min_nodes        : {nnodes}\n"
        f"  max_nodes        : {nnodes}\n  nproc_per_node   : 8\n  run_id           : job77",
    ]
    if group_rank is not None:
        lines.append(
            "I1201 08:00:05.200000 9001 torch/distributed/elastic/agent/server/api.py:525] "
            f"[default] Rendezvous complete for workers. Result:\n  restart_count=0\n"
            f"  master_addr=10.0.0.1\n  master_port=29500\n  group_rank={group_rank}\n"
            f"  group_world_size={nnodes}\n  local_ranks=[0, 1, 2, 3, 4, 5, 6, 7]"
        )
    return "\n".join(lines).splitlines()


_EXIT = (
    "E1201 09:14:41.002000 9001 torch/distributed/elastic/multiprocessing/api.py:869] failed "
    "(exitcode: 1) local_rank: 3 (pid: 4121) of binary: /usr/bin/python3"
)


def test_a_local_rank_on_a_multi_node_job_is_not_the_global_rank() -> None:
    [ev] = feed([*_torchrun_head(2, group_rank=1), _EXIT])
    assert (ev.rank, ev.local_rank) == (11, 3)  # 1 * 8 + 3
    [ev] = feed([*_torchrun_head(2, group_rank=None), _EXIT])
    assert (ev.rank, ev.local_rank) == (None, 3)
    [ev] = feed([*_torchrun_head(1, group_rank=None), _EXIT])
    assert (ev.rank, ev.local_rank) == (3, 3)  # one node: the local rank is the global one


def test_ray_actor_prefixes_name_the_node_and_worker_not_a_rank() -> None:
    lines = [
        "(WorkerDict pid=8812, ip=10.0.0.3) [rank3]: Traceback (most recent call last):",
        '(WorkerDict pid=8812, ip=10.0.0.3) [rank3]:   File "/opt/verl/worker.py", line 10, in x',
        "(WorkerDict pid=8812, ip=10.0.0.3) [rank3]:     run()",
        "(WorkerDict pid=8812, ip=10.0.0.3) [rank3]: ValueError: bad shape",
        "(TaskRunner pid=7001) Traceback (most recent call last):",
        '(TaskRunner pid=7001)   File "/opt/verl/main.py", line 10, in run',
        "(TaskRunner pid=7001)     run()",
        "(TaskRunner pid=7001) KeyError: 'reward'",
        "(WorkerDict pid=8813, ip=10.0.0.4) INFO worker started: local_rank=2 device=npu:2",
        "(WorkerDict pid=8813, ip=10.0.0.4) RuntimeError: NPU function error: "
        "c10_npu::acl::AclrtSynchronizeStream(stream), error code is 507035",
        "(RayWorkerWrapper pid=51234, ip=10.0.0.12) RuntimeError: NPU out of memory. Tried to "
        "allocate 2.00 GiB (NPU 3; 60.96 GiB total capacity; 58.10 GiB already allocated; "
        "1.20 GiB free)",
    ]
    got = [(e.kind, e.rank, e.node, e.fields.get("worker")) for e in feed(lines)]
    assert got == [
        ("process_failure", 3, "10.0.0.3", "WorkerDict"),
        ("process_failure", None, None, "TaskRunner"),
        ("process_failure", None, "10.0.0.4", "WorkerDict"),  # its local rank 2 is no rank
        ("oom", None, "10.0.0.12", "RayWorkerWrapper"),
    ]


# --- stage and counters from the record's context -------------------------------------------------


@pytest.mark.parametrize(
    ("before", "stage"),
    [
        ("2026-12-01 10:00:05,001 - INFO - Evaluating on the dev split (2048 examples)", "val"),
        ("[2026-12-01 10:00:05] Validating after epoch 3 ...", "val"),
        ("2026-12-01 10:00:05,001 - INFO - Saving model checkpoint to /out/ckpt-500", "train"),
        (" saving checkpoint at iteration    2000 to /ckpt/run7", "train"),
        ("2026/12/01 10:00:05 - mmengine - INFO - Saving checkpoint at 4 epochs", "train"),
        ("[INFO] [Torch] Checkpoint global_step900 is about to be saved!", "train"),
        (
            "Epoch 3, global step 1200: 'val_loss' reached 0.51, saving model to '/ck/e3.ckpt'",
            "train",
        ),
    ],
)
def test_a_failure_right_after_an_eval_or_save_line_takes_its_stage(
    before: str, stage: str
) -> None:
    lines = [
        before,
        "Traceback (most recent call last):",
        *frames(),
        "OSError: [Errno 28] No space left on device",
    ]
    assert [(e.kind, e.stage) for e in feed(lines)] == [("process_failure", stage)]


def test_another_ranks_eval_line_does_not_stage_a_failure() -> None:
    lines = [
        "[rank0]: Evaluating on the dev split (2048 examples)",
        "[rank3]: Traceback (most recent call last):",
        *frames("[rank3]: "),
        "[rank3]: OSError: [Errno 5] Input/output error",
    ]
    assert [(e.rank, e.stage) for e in feed(lines)] == [(3, None)]


def test_a_step_line_fills_step_and_an_iter_line_fills_iter() -> None:
    [ev] = feed(["2026-12-01 10:00:00,001 - INFO - step 1200 | loss: nan | lr: 1.0e-04"])
    assert (ev.step, ev.iter) == (1200, None)
    [ev] = feed(["2026-12-01 10:00:00,001 - INFO - iter 300 | loss: nan | lr: 1.0e-04"])
    assert ev.iter == 300
    [ev] = feed(
        ["2026/12/01 10:00:00 - mmengine - INFO - Iter(train) [ 300/900]  lr: 1e-04  loss: nan"]
    )
    assert ev.iter == 300
