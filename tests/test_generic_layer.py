"""The generic layer under the rule packs: tracebacks read as records, vendor error codes that
join the failure report they belong to, any non-finite metric, host OOM kills that explain the
ranks they killed, and quiet healthy logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nanwatch.cli import cli
from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.errors import RuleError
from nanwatch.events import Event
from nanwatch.simulate import TrainingRun

DETECTOR = Detector(load_rules(), default_year=2026)
FIXTURES = Path(__file__).parent / "fixtures"


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
    from nanwatch.detect import engine

    monkeypatch.setattr(engine, "RECORD_LINES", 5)
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
