"""A caused incident's origin, title and story come from its root event, never a symptom."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import hccl_ei0002, mmengine_iter_line, npu_oom_traceback
from nanwatch.query import list_incidents
from nanwatch.store import Store

T0 = dt.datetime(2026, 11, 30, 10, 0, 0)


def scan(db: Path, *paths: Path) -> list[dict[str, Any]]:
    store = Store.open(db)
    try:
        Pipeline(Config(), store, [str(p) for p in paths]).scan()
        return list_incidents(store._conn)
    finally:
        store.close()


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def train_line(seconds: float, it: int = 10) -> str:
    return mmengine_iter_line(at(seconds), "train", 1, it, 100, step_time=0.5, losses={"loss": 1})


def val_line(seconds: float, it: int = 10) -> str:
    return mmengine_iter_line(at(seconds), "val", 2, it, 50, step_time=0.24, lr=None)


def assert_rooted_at_rank_3(inc: dict[str, Any], others: int = 7) -> None:
    assert inc["kind"] == "oom"
    assert inc["origin"]["rank"] == 3
    assert inc["title"].startswith("Out of memory on rank 3")
    assert f"{others} other ranks then timed out" in inc["title"]
    assert inc["detail"]["root_cause"].startswith("Rank 3 ran out of device memory")
    assert 3 not in inc["detail"]["symptom_ranks"]


@pytest.mark.parametrize("when", ["missing", "equal", "later"])
def test_the_oom_roots_the_incident_whatever_its_time_says(
    tmp_path: Path, db: Path, when: str
) -> None:
    """Rank 3 runs out of memory; the seven others then time out in HCCL naming it. The OOM's
    traceback has no time of its own (missing: not even a line before it in its file), one
    equal to rank 0's timeout, or one later than the timeouts (node clocks disagree); rank 0
    itself was in validation."""
    run = tmp_path / "job"
    oom_at = {"missing": None, "equal": 1800.0, "later": 2400.0}[when]
    for r in range(8):
        if r == 3:
            if oom_at is None:
                write_lines(run / "rank3.log", [train_line(0.0)])
                write_lines(run / "rank3.err", npu_oom_traceback(3))
            else:
                write_lines(run / "rank3.log", [val_line(oom_at), *npu_oom_traceback(3)])
            continue
        before = val_line(1790.0) if r == 0 else train_line(0.0)
        write_lines(run / f"rank{r}.log", [before, *hccl_ei0002(at(1800.0 + r), r, 3, pid=r)])
    (inc,) = scan(db, run)
    assert_rooted_at_rank_3(inc)
    assert inc["ranks"] == list(range(8)) and inc["event_count"] == 8


def test_a_root_behind_more_than_200_symptoms(tmp_path: Path, db: Path) -> None:
    """255 ranks' timeouts (each with its step) are read first; rank 3's log arrives later
    (copied from its node): the OOM takes them over and roots the incident."""
    run = tmp_path / "job"
    for r in range(256):
        if r != 3:
            lines = [train_line(0.0), *hccl_ei0002(at(1800.0 + r / 100), r, 3, pid=r)]
            write_lines(run / f"rank{r}.log", lines)
    (orphan,) = scan(db, run)
    assert orphan["kind"] == "comm_timeout"
    write_lines(run / "rank3.log", [train_line(0.0), *npu_oom_traceback(3)])
    (inc,) = scan(db, run)
    assert_rooted_at_rank_3(inc, others=255)
    assert inc["event_count"] == 256


def oom_on(run: Path, rank: int, seconds: float) -> None:
    lines = [val_line(seconds), *npu_oom_traceback(rank)]
    write_lines(run / f"rank{rank}.log", [x.replace("(NPU 3;", f"(NPU {rank};") for x in lines])


def test_an_equal_or_unknown_time_does_not_move_the_root(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "job"
    oom_on(run, 5, 60.0)
    (first,) = scan(db, run)
    assert first["origin"]["rank"] == 5
    oom_on(run, 2, 60.0)  # another rank's OOM, read later, at the same time
    write_lines(run / "rank4.err", npu_oom_traceback(4))  # and one with no time at all
    (inc,) = scan(db, run)
    assert inc["kind"] == "oom" and inc["ranks"] == [2, 4, 5]
    assert inc["origin"]["rank"] == 5 and inc["title"].startswith("Out of memory on rank 5")


def test_an_oom_known_to_be_earlier_moves_the_root(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "job"
    oom_on(run, 5, 60.0)
    scan(db, run)
    oom_on(run, 2, 30.0)
    (inc,) = scan(db, run)
    assert inc["origin"]["rank"] == 2 and inc["title"].startswith("Out of memory on rank 2")


FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("first", ["launcher", "workers"])
def test_a_watchdog_abort_is_the_timeouts_effect_whichever_log_is_read_first(
    tmp_path: Path, db: Path, first: str
) -> None:
    """The NCCL watchdog takes rank 0's process down; torchrun reports the exit (-6,
    SIGABRT). Read in either order, the timeout is the root and the exit its effect."""
    text = (FIXTURES / "nccl_watchdog_teardown" / "train.log").read_text().splitlines()
    parts = {
        "workers": [x for x in text if x.startswith("[rank")],
        "launcher": [x for x in text if not x.startswith("[rank")],
    }
    run = tmp_path / "job"
    second = "launcher" if first == "workers" else "workers"
    write_lines(run / f"{first}.log", parts[first])
    (alone,) = scan(db, run)
    assert alone["kind"] == ("process_failure" if first == "launcher" else "comm_timeout")
    write_lines(run / f"{second}.log", parts[second])
    (inc,) = scan(db, run)
    assert inc["kind"] == "comm_timeout" and inc["ranks"] == [0, 1, 3]
    assert inc["event_count"] == 4 and inc["origin"]["rank"] == 0
    assert inc["detail"]["exited_ranks"] == [0]
    assert "watchdogs took the processes down" in inc["detail"]["root_cause"]


def torchrun_exit(seconds: float, rank: int, code: int) -> list[str]:
    stamp = at(seconds).strftime("%Y-%m-%d %H:%M:%S,000")
    return [
        f"[{stamp}] torch.distributed.elastic.multiprocessing.api: [ERROR] failed "
        f"(exitcode: {code}) local_rank: {rank} (pid: {4700 + rank}) of binary: /usr/bin/python3"
    ]


def watchdog_timeout(seconds: float, rank: int) -> list[str]:
    t = at(seconds)
    stamp = f"E{t:%m%d %H:%M:%S}.000000000"
    return [
        f"[rank{rank}]:[{stamp} ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=812, OpType=ALLREDUCE, NumelIn=1024, "
        "NumelOut=1024, Timeout(ms)=600000) ran for 600031 milliseconds before timing out.",
        f"[rank{rank}]:[{stamp} ProcessGroupNCCL.cpp:636] [Rank {rank}] To avoid data "
        "inconsistency, we are taking the entire process down.",
    ]


def test_an_abort_without_a_failure_of_its_own_rank_stays_the_root(
    tmp_path: Path, db: Path
) -> None:
    """Rank 0 aborts (a C++ assert) at 10:00; rank 1 times out waiting for it ten minutes
    later, and its watchdog takes it down: rank 0's exit is the root."""
    run = tmp_path / "job"
    write_lines(run / "launcher.log", [*torchrun_exit(5.0, 0, -6), *torchrun_exit(610.0, 1, -6)])
    write_lines(run / "rank1.log", watchdog_timeout(605.0, 1))
    (inc,) = scan(db, run)
    assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 0
    assert inc["ranks"] == [0, 1] and inc["event_count"] == 3


UNTIMED_TIMEOUT = (
    "RuntimeError: NCCL communicator was aborted on rank 0.  Original reason for failure was: "
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=91, "
    "OpType=ALLGATHER, Timeout(ms)=900000) ran for 900412 milliseconds before timing out."
)
UNTIMED_ABORT = (
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -6) local_rank: 2 "
    "(pid: 51002) of binary: /opt/venv/bin/python"
)


@pytest.mark.parametrize("abort_first", [False, True])
def test_another_ranks_abort_after_a_timeout_in_the_same_log_is_its_effect(
    tmp_path: Path, db: Path, abort_first: bool
) -> None:
    """No line has a time. Rank 0's watchdog times out, then the launcher reports rank 2's
    abort (SIGABRT, what every rank's watchdog does in a hung collective): the timeout is the
    root. Reported the other way round (the abort first: a launcher ends the others when one
    crashes), the abort stays the root."""
    lines = [UNTIMED_ABORT, UNTIMED_TIMEOUT] if abort_first else [UNTIMED_TIMEOUT, UNTIMED_ABORT]
    write_lines(tmp_path / "job" / "train.log", lines)
    (inc,) = scan(db, tmp_path / "job")
    assert inc["event_count"] == 2 and inc["ranks"] == [0, 2]
    if abort_first:
        assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 2
    else:
        assert inc["kind"] == "comm_timeout" and inc["origin"]["rank"] == 0


UNTIMED_EXCEPTION = [
    "[rank2]: Traceback (most recent call last):",
    '[rank2]:   File "/srv/rl/run_policy.py", line 40, in <module>',
    "[rank2]:     main()",
    "[rank2]: KeyError: 'reward'",
]


@pytest.mark.parametrize("failure_first", [False, True])
def test_a_timeout_printed_before_another_ranks_failure_is_not_its_symptom(
    tmp_path: Path, db: Path, failure_first: bool
) -> None:
    """No line has a time; one log holds both. A rank's exception printed first explains the
    timeout printed after it; printed after the timeout, it cannot be what the timeout waited
    for, and the timeout stays a root of its own."""
    lines = (
        [*UNTIMED_EXCEPTION, UNTIMED_TIMEOUT]
        if failure_first
        else [UNTIMED_TIMEOUT, *UNTIMED_EXCEPTION]
    )
    write_lines(tmp_path / "job" / "train.log", lines)
    incs = scan(db, tmp_path / "job")
    if failure_first:
        (inc,) = incs
        assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 2
        assert inc["event_count"] == 2
    else:
        kinds = {i["kind"]: i for i in incs}
        assert kinds["comm_timeout"]["origin"]["rank"] == 0
        assert kinds["comm_timeout"]["event_count"] == 1


def test_a_timeout_stays_apart_from_a_kill_the_launcher_reports_after_it(
    tmp_path: Path, db: Path
) -> None:
    """Untimed: rank 0's watchdog timeout, then torchrun's report that rank 1 was killed, then
    torchrun's own traceback. The traceback joins the timeout (the launcher going down after
    it), but does not carry the timeout over to the kill reported after it."""
    lines = [
        "[E ProcessGroupNCCL.cpp:737] [Rank 0] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=88, OpType=BROADCAST, Timeout(ms)=600000) ran for 600412 milliseconds "
        "before timing out.",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 1 "
        "(pid: 4411) of binary: /opt/venv/bin/python",
        "Traceback (most recent call last):",
        '  File "/opt/venv/bin/torchrun", line 8, in <module>',
        "    sys.exit(main())",
        '  File "/opt/venv/lib/python3.10/site-packages/torch/distributed/run.py", line 752, '
        "in run",
        "    elastic_launch(",
    ]
    write_lines(tmp_path / "job" / "train.log", lines)
    kinds = {i["kind"]: i for i in scan(db, tmp_path / "job")}
    assert set(kinds) == {"comm_timeout", "process_failure"}
    assert kinds["comm_timeout"]["origin"]["rank"] == 0
    assert kinds["process_failure"]["origin"]["rank"] == 1


def test_an_exit_long_after_its_ranks_timeout_is_not_its_effect(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "job"
    write_lines(run / "rank1.log", watchdog_timeout(0.0, 1))
    write_lines(run / "launcher.log", torchrun_exit(3 * 3600.0, 1, -6))
    kinds = sorted(i["kind"] for i in scan(db, run))
    assert kinds == ["comm_timeout", "process_failure"]


def test_a_rank_that_died_without_a_line_is_the_root_the_others_name(
    tmp_path: Path, db: Path
) -> None:
    """Rank 5 is killed by the host's OOM killer and prints nothing; the seven others time
    out in HCCL naming it: the incident's origin is rank 5, with the ranks that named it."""
    run = tmp_path / "node"
    for r in (0, 1, 2, 3, 4, 6, 7):
        write_lines(
            run / f"rank{r}.log", [train_line(0.0), *hccl_ei0002(at(1800 + r), r, 5, pid=r)]
        )
    (inc,) = scan(db, run)
    assert inc["kind"] == "comm_timeout" and inc["ranks"] == [0, 1, 2, 3, 4, 6, 7]
    assert inc["origin"]["rank"] == 5
    assert inc["origin"]["evidence"] == {
        "named_by": [0, 1, 2, 3, 4, 6, 7],
        "silent": True,
        "first_seen_rank": 0,
    }
    assert inc["title"].startswith("Rank 5 stopped responding: HCCL timeout on ranks 0-4,6-7")
    assert inc["detail"]["cause_rank"] == 5
    assert inc["detail"]["root_cause"].startswith("Rank 5 stopped responding")


def test_the_silent_rank_is_the_end_of_the_chain(tmp_path: Path, db: Path) -> None:
    """Ranks 4 and 5 wait for rank 3, which itself waits for rank 7: rank 7 printed nothing."""
    run = tmp_path / "node"
    for r, remote in ((4, 3), (5, 3), (3, 7)):
        write_lines(run / f"rank{r}.log", hccl_ei0002(at(1800 + r), r, remote, pid=r))
    (inc,) = scan(db, run)
    assert inc["origin"]["rank"] == 7 and inc["origin"]["evidence"]["named_by"] == [3]


def test_the_launchers_report_of_a_killed_rank_is_the_evidence(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "node"
    for r in (4, 5, 6):
        write_lines(run / f"rank{r}.log", hccl_ei0002(at(1800 + r), r, 3, pid=r))
    write_lines(run / "launcher.log", torchrun_exit(1.0, 3, -9))
    (inc,) = scan(db, run)
    assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 3
    evidence = inc["origin"]["evidence"]
    assert evidence["named_by"] == [4, 5, 6]
    assert (evidence["exit_code"], evidence["signal"]) == (-9, "SIGKILL")
    assert "local rank 3 was killed" in evidence["report"]
    assert inc["title"].startswith("Process failure of rank 3 (SIGKILL)")
    assert "Ranks 4-6 named it as the peer they waited for" in inc["detail"]["root_cause"]


def test_a_named_rank_that_reported_its_own_failure_is_not_silent(tmp_path: Path, db: Path) -> None:
    """Rank 3's timeout names rank 5 and rank 5's names rank 3 (each waited for the other):
    neither is silent, the origin stays the first failure."""
    run = tmp_path / "node"
    write_lines(run / "rank3.log", hccl_ei0002(at(1800), 3, 5, pid=3))
    write_lines(run / "rank5.log", hccl_ei0002(at(1801), 5, 3, pid=5))
    (inc,) = scan(db, run)
    assert inc["origin"]["rank"] == 3 and "evidence" not in inc["origin"]
    assert not inc["title"].startswith("Rank")


def test_an_nccl_desync_report_names_the_rank_that_stopped_responding(
    tmp_path: Path, db: Path
) -> None:
    """TORCH_NCCL_DESYNC_DEBUG=1: each waiting rank's watchdog report names rank 5, which
    finished collective #812 and never joined #813; rank 5 printed nothing."""
    lines = []
    for r in (0, 1, 2, 3):
        stamp = f"[rank{r}]:[E1130 10:12:41.20{r}113046 ProcessGroupNCCL.cpp:632]"
        lines += [
            f"{stamp} [Rank {r}] Watchdog caught collective operation timeout: WorkNCCL("
            "SeqNum=813, OpType=ALLREDUCE, NumelIn=4096, NumelOut=4096, Timeout(ms)=600000) "
            "ran for 600017 milliseconds before timing out.",
            f"[rank{r}]:[E1130 10:12:41.20{r}630512 ProcessGroupNCCL.cpp:1937] Rank {r}",
            f"[rank{r}]:         - [{r}] Timeout at collective: ALLREDUCE, #813",
            f"[rank{r}]:         - To our best knowledge, the lagging/dead/mismatched ranks "
            "that caused the desync are:",
            f"[rank{r}]:             [5] finished collective #812, but didn't join collective "
            "#813 (count from 1)",
        ]
    write_lines(tmp_path / "job" / "train.log", lines)
    (inc,) = scan(db, tmp_path / "job")
    assert inc["kind"] == "comm_timeout" and inc["ranks"] == [0, 1, 2, 3]
    assert inc["origin"]["rank"] == 5
    assert inc["origin"]["evidence"]["named_by"] == [0, 1, 2, 3]
    assert inc["title"].startswith("Rank 5 stopped responding: NCCL timeout on ranks 0-3")


def test_the_launchers_first_observed_failure_is_the_root_not_the_ranks_it_stopped(
    tmp_path: Path, db: Path
) -> None:
    """torchrun's summary lists the workers it stopped (SIGTERM) before the root cause, all
    under the same time: rank 3's segfault is the root."""
    entry = [
        "  time      : 2026-11-30_10:00:05",
        "  host      : gpu-node-1",
        "  rank      : {r} (local_rank: {r})",
        "  exitcode  : {code} (pid: 470{r})",
        "  error_file: <N/A>",
        "  traceback : Signal {sig} ({name}) received by PID 470{r}",
    ]
    lines = [
        "[2026-11-30 10:00:04,917] torch.distributed.elastic.multiprocessing.api: [WARNING] "
        "Sending process 4700 closing signal SIGTERM",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "Failures:",
    ]
    for k, r in enumerate((0, 1, 2), start=1):
        lines += [f"[{k}]:", *(x.format(r=r, code=-15, sig=15, name="SIGTERM") for x in entry)]
    lines += ["Root Cause (first observed failure):", "[0]:"]
    lines += [x.format(r=3, code=-11, sig=11, name="SIGSEGV") for x in entry]
    write_lines(tmp_path / "job" / "launcher.log", lines)
    (inc,) = scan(db, tmp_path / "job")
    assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 3
    assert inc["origin"]["evidence"]["signal"] == "SIGSEGV"


def test_a_device_fault_after_a_timeout_on_its_rank_is_a_root_of_its_own(
    tmp_path: Path, db: Path
) -> None:
    run = tmp_path / "job"
    write_lines(
        run / "rank1.log",
        [*hccl_ei0002(at(0.0), 1, 3, pid=1), "[Error]: The aicore execution is abnormal. "],
    )
    (inc,) = scan(db, run)
    assert inc["kind"] == "process_failure" and inc["origin"]["rank"] == 1


def test_an_oom_read_after_the_watchdog_aborts_it_caused_roots_them_all(
    tmp_path: Path, db: Path
) -> None:
    """gpu-node-7's log (timeouts, aborts) is read first, gpu-node-8's (rank 6's OOM) later:
    the timeout incident with its exits joins the OOM's."""
    import shutil

    logs = FIXTURES / "cuda_oom_nccl_teardown" / "logs"
    run = tmp_path / "logs"
    shutil.copytree(logs / "gpu-node-7", run / "gpu-node-7")
    (first,) = scan(db, run)
    assert first["kind"] == "comm_timeout" and first["detail"]["exited_ranks"] == [0, 1, 2, 3]
    shutil.copytree(logs / "gpu-node-8", run / "gpu-node-8")
    (inc,) = scan(db, run)
    assert inc["kind"] == "oom" and inc["origin"]["rank"] == 6 and inc["event_count"] == 11
    assert inc["title"].startswith("Out of memory on rank 6")


def test_ranks_that_failed_in_a_collective_are_not_said_to_have_timed_out(
    tmp_path: Path, db: Path
) -> None:
    run = tmp_path / "job"
    oom_on(run, 3, 0.0)
    stamp = at(30.0).strftime("%Y-%m-%d-%H:%M:%S")
    write_lines(
        run / "rank0.log",
        [f"[ERROR] {stamp} (PID:4100, Device:0, RankID:0) ERR02200 DIST call hccl api failed."],
    )
    (inc,) = scan(db, run)
    assert inc["kind"] == "oom" and inc["origin"]["rank"] == 3
    assert "1 other rank then failed in HCCL" in inc["title"]
    assert "timed out" not in inc["title"]


@pytest.mark.parametrize("abort", ["Aborted (core dumped)", "已放弃 (核心已转储)"])
def test_the_abort_after_a_rank_s_own_nccl_error_is_its_effect(
    tmp_path: Path, db: Path, abort: str
) -> None:
    """C++'s terminate after an uncaught NCCL error aborts the process; the shell reports the
    abort in its locale's words. The communication error roots the incident."""
    lines = [
        "terminate called after throwing an instance of 'std::runtime_error'",
        "  what():  NCCL Error 3: internal error - please report this issue to the NCCL developers",
        abort,
    ]
    write_lines(tmp_path / "job" / "train.log", lines)
    (inc,) = scan(db, tmp_path / "job")
    assert inc["kind"] == "comm_error"
    assert inc["event_count"] == 2
