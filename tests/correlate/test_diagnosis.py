"""Diagnosis: causal chains, slowdowns, lifecycle, hints — on the seed case and variations."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.demo.simulate import (
    TrainingRun,
    hccl_ei0002,
    mmengine_iter_line,
    npu_oom_traceback,
    seed_scenario,
)
from nanwatch.query import list_incidents, show_incident
from nanwatch.store import Store


def scan(db: Path, *paths: Path | str) -> list[dict[str, Any]]:
    store = Store.open(db)
    try:
        Pipeline(Config(), store, [str(p) for p in paths]).scan()
        return list_incidents(store._conn)
    finally:
        store.close()


def incidents(db: Path, **kw: Any) -> list[dict[str, Any]]:
    store = Store.open(db, readonly=True)
    try:
        return list_incidents(store._conn, **kw)
    finally:
        store.close()


@pytest.fixture
def seed(tmp_path: Path) -> tuple[TrainingRun, TrainingRun]:
    a, b = seed_scenario(tmp_path)
    a.write()
    b.write()
    return a, b


def test_validation_oom_roots_the_hccl_timeouts(
    seed: tuple[TrainingRun, TrainingRun], db: Path
) -> None:
    run_a, _ = seed
    incs = scan(db, run_a.launch_dir)
    assert [i["kind"] for i in incs] == ["oom"]  # no comm_timeout incident of their own
    (oom,) = incs
    assert oom["origin"]["rank"] == 3 and oom["origin"]["stage"] == "val"
    assert oom["ranks"] == list(range(8))
    assert oom["event_count"] == 8
    hints = oom["hints"]
    assert hints[0]["id"] == "oom-validation-collective-timeouts"
    text = hints[0]["text"]
    assert "HCCL_EXEC_TIMEOUT" in text and "will\nnot help" in text.replace(
        " not help", "\nnot help"
    )
    assert "validation" in text and "batch size" in text
    assert not any("embedding" in h["id"] or "cann" in h["id"] for h in hints)
    assert "symptom" in oom["detail"]["root_cause"]
    assert oom["detail"]["symptom_ranks"] == [0, 1, 2, 4, 5, 6, 7]


def test_slowdown_against_the_previous_run_scanned_separately(
    seed: tuple[TrainingRun, TrainingRun], db: Path
) -> None:
    run_a, run_b = seed
    scan(db, run_a.launch_dir)
    scan(db, run_b.launch_dir)
    slow = [i for i in incidents(db) if i["kind"] == "slowdown"]
    assert len(slow) == 1
    assert slow[0]["run"].endswith("20261201_090000")
    assert 3.0 <= slow[0]["origin"]["ratio"] <= 3.6
    assert slow[0]["hints"][0]["id"] == "slowdown-cpu-fallback"
    store = Store.open(db, readonly=True)
    ev = json.loads(
        store._conn.execute("SELECT fields FROM events WHERE kind = 'slowdown'").fetchone()[0]
    )
    store.close()
    assert {"ratio", "baseline", "current"} <= set(ev)
    assert 0.8 <= ev["baseline"] <= 0.95 and 2.6 <= ev["current"] <= 3.1


def test_first_nan_in_the_embedding_names_cann_empty_labels_and_the_dataset_check(
    seed: tuple[TrainingRun, TrainingRun], db: Path
) -> None:
    _, run_b = seed
    (nan,) = [i for i in scan(db, run_b.launch_dir) if i["kind"] == "nan"]
    o = nan["origin"]
    assert (o["rank"], o["step"], o["tag"]) == (6, 527, "grad_unreduced")
    assert o["tensor"] == "module.dn_query_generator.label_embedding.weight"
    assert o["shape"] == [80, 256] and o["module"] == "dn_query_generator.label_embedding"
    assert nan["ranks"] == list(range(8))
    ids = [h["id"] for h in nan["hints"]]
    assert ids[:2] == ["nan-embedding-empty-input-cann", "empty-gt-labels-out-of-range-classes"]
    text = " ".join(h["title"] + h["text"] + " ".join(h["commands"]) for h in nan["hints"])
    assert "8.0.0" in text and "gt_labels" in text and "nanwatch check-dataset" in text
    assert not any("hccl" in i or "collective" in i for i in ids)


def test_slowdown_found_when_the_slow_run_is_scanned_first(
    seed: tuple[TrainingRun, TrainingRun], db: Path
) -> None:
    run_a, run_b = seed
    scan(db, run_b.launch_dir)
    assert not [i for i in incidents(db) if i["kind"] == "slowdown"]
    scan(db, run_a.launch_dir)
    slow = [i for i in incidents(db) if i["kind"] == "slowdown"]
    assert len(slow) == 1 and slow[0]["run"].endswith("20261201_090000")


def test_symptoms_scanned_before_their_root_are_absorbed(
    seed: tuple[TrainingRun, TrainingRun], db: Path
) -> None:
    run_a, _ = seed
    rank3 = run_a.rank_path(3)
    held = rank3.read_bytes()
    rank3.unlink()
    scan(db, run_a.launch_dir)  # the seven timeouts only: an orphan
    orphan = incidents(db)
    assert [i["kind"] for i in orphan] == ["comm_timeout"]
    assert orphan[0]["detail"]["cause_rank"] == 3
    rank3.write_bytes(held)  # rank 3's log arrives (e.g. copied from its node)
    scan(db, run_a.launch_dir)
    final = incidents(db)
    assert [i["kind"] for i in final] == ["oom"], final
    assert final[0]["ranks"] == list(range(8))
    merged = incidents(db, include_merged=True)
    assert sorted(i["status"] for i in merged) == ["merged", "open"]


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))


T0 = dt.datetime(2026, 11, 30, 10, 0, 0)


def test_named_remote_rank_links_whatever_the_time(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "job"
    write_lines(
        run / "rank3.log",
        [mmengine_iter_line(T0, "train", 1, 10, 100, step_time=0.5), *npu_oom_traceback(3)],
    )
    much_later = T0 + dt.timedelta(hours=9)
    write_lines(run / "rank1.log", hccl_ei0002(much_later, 1, 3, pid=11))
    (oom,) = scan(db, run)
    assert oom["kind"] == "oom" and oom["ranks"] == [1, 3]


def test_unrelated_timeout_hours_later_without_remote_rank_is_its_own_incident(
    tmp_path: Path, db: Path
) -> None:
    run = tmp_path / "job"
    write_lines(
        run / "rank3.log",
        [mmengine_iter_line(T0, "train", 1, 10, 100, step_time=0.5), *npu_oom_traceback(3)],
    )
    later = T0 + dt.timedelta(hours=9)
    lines = hccl_ei0002(later, 1, 3, pid=11)
    lines = [x.replace("remote rank: [3]", "remote rank: [unknown]") for x in lines]
    write_lines(run / "rank1.log", lines)
    kinds = sorted(i["kind"] for i in scan(db, run))
    assert kinds == ["comm_timeout", "oom"]


def test_orphan_timeout_carries_the_rank_it_points_at(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "node-b"
    for r in (4, 5):
        write_lines(run / f"rank{r}.log", hccl_ei0002(T0, r, 3, pid=100 + r))
    (inc,) = scan(db, run)
    assert inc["kind"] == "comm_timeout"
    assert inc["detail"]["cause_rank"] == 3
    assert inc["ranks"] == [4, 5]
    assert inc["hints"][0]["id"] == "collective-timeout-find-first-failure"


def test_timeouts_naming_their_backend_or_not_are_one_incident(tmp_path: Path, db: Path) -> None:
    stuck = (
        "[rank{r}]:[F ProcessGroupNCCL.cpp:1169] [PG 0 Rank {r}] ProcessGroupNCCL's watchdog got "
        "stuck for 600 seconds without making progress in monitoring enqueued collectives."
    )
    bare = "[rank{r}]: [PG 0 Rank {r}] Heartbeat monitor timed out! Process will be terminated."
    for first, lines in (("named", [stuck, bare, bare]), ("unnamed", [bare, stuck, bare])):
        run = tmp_path / first
        write_lines(run / "train.log", [line.format(r=r) for r, line in enumerate(lines)])
        (inc,) = scan(tmp_path / f"{first}.db", run)
        assert inc["kind"] == "comm_timeout" and inc["ranks"] == [0, 1, 2], first


def test_an_aborted_communicator_and_a_watchdog_timeout_are_one_incident(
    tmp_path: Path, db: Path
) -> None:
    run = tmp_path / "job"
    write_lines(run / "rank3.log", ["RuntimeError: NCCL communicator was aborted on rank 3."])
    write_lines(
        run / "rank5.log",
        [
            "[E ProcessGroupNCCL.cpp:587] [Rank 5] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=8812, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800423 "
            "milliseconds before timing out."
        ],
    )
    (inc,) = scan(db, run)
    assert inc["kind"] in ("comm_error", "comm_timeout") and inc["ranks"] == [3, 5]


def test_a_worker_that_raised_a_comm_error_is_not_the_root_of_it(tmp_path: Path, db: Path) -> None:
    # one stdout: the NCCL error raised in the worker, then torchrun's report of its exit
    write_lines(
        tmp_path / "job" / "train.log",
        [
            "Traceback (most recent call last):",
            '  File "train.py", line 12, in <module>',
            "    model = DistributedDataParallel(model, device_ids=[0])",
            "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275,"
            " unhandled system error, NCCL version 2.14.3",
            "[2026-11-30 10:00:05,120] torch.distributed.elastic.multiprocessing.api: [ERROR] "
            "failed (exitcode: 1) local_rank: 0 (pid: 4711) of binary: /usr/bin/python3",
        ],
    )
    (inc,) = scan(db, tmp_path / "job")
    assert inc["kind"] == "comm_error" and inc["event_count"] == 2


def test_a_killed_worker_stays_the_root_of_the_others_timeouts(tmp_path: Path, db: Path) -> None:
    run = tmp_path / "job"
    write_lines(
        run / "launcher.log",
        [
            "[2026-11-30 10:00:00,000] torch.distributed.elastic.multiprocessing.api: [ERROR] "
            "failed (exitcode: -9) local_rank: 3 (pid: 4711) of binary: /usr/bin/python3",
        ],
    )
    for r in (4, 5):
        write_lines(run / f"rank{r}.log", hccl_ei0002(T0, r, 3, pid=100 + r))
    kinds = [i["kind"] for i in scan(db, run)]
    assert kinds == ["process_failure"]


def _train_lines(
    times: list[float], *, start: dt.datetime = T0, rank_nan_at: int | None = None
) -> list[str]:
    out, t = [], 0.0
    for i, st in enumerate(times, start=1):
        t += st * 10
        loss = {"loss": float("nan") if rank_nan_at is not None and i >= rank_nan_at else 0.5}
        out.append(
            mmengine_iter_line(
                start + dt.timedelta(seconds=t),
                "train",
                1,
                i * 10,
                len(times) * 10,
                step_time=st,
                losses=loss,
            )
        )
    return out


def test_jitter_warmup_and_validation_raise_no_slowdown(tmp_path: Path, db: Path) -> None:
    import random

    rng = random.Random(4)
    times = [3.0, 2.0, 1.5] + [0.86 * rng.uniform(0.8, 1.2) for _ in range(60)]
    lines = _train_lines(times)
    val = [
        mmengine_iter_line(T0 + dt.timedelta(hours=1), "val", 1, i, 50, step_time=5.0, lr=None)
        for i in range(10, 51, 10)
    ]
    write_lines(tmp_path / "job" / "rank0.log", lines[:30] + val + lines[30:])
    assert [i["kind"] for i in scan(db, tmp_path / "job")] == []


def test_millisecond_steps_jittering_are_not_a_slowdown(tmp_path: Path, db: Path) -> None:
    times = [0.0008, 0.0013, 0.0009] * 10 + [0.0025] * 20  # 3x, but 2 ms
    write_lines(tmp_path / "job" / "rank0.log", _train_lines(times))
    assert scan(db, tmp_path / "job") == []


def test_mid_run_slowdown_against_own_baseline(tmp_path: Path, db: Path) -> None:
    times = [0.86] * 40 + [2.84] * 30
    write_lines(tmp_path / "job" / "rank0.log", _train_lines(times))
    (inc,) = scan(db, tmp_path / "job")
    assert inc["kind"] == "slowdown"
    assert 3.0 <= inc["origin"]["ratio"] <= 3.6
    assert inc["origin"]["step"] == 410  # the first slow logged step


def test_nan_recovery_resolves_and_a_recurrence_opens_a_new_incident(
    tmp_path: Path, db: Path
) -> None:
    log = tmp_path / "job" / "rank0.log"
    base = _train_lines([0.5] * 30)
    nan = [x.replace("loss: 0.5000", "loss: nan") for x in base[5:8]]
    write_lines(log, base[:5] + nan + base[8:])
    (inc,) = scan(db, tmp_path / "job")
    assert inc["status"] == "resolved"
    assert "finite" in inc["detail"]["resolution"]
    later = [x.replace("[1]", "[2]").replace("loss: 0.5000", "loss: nan") for x in base[:2]]
    with log.open("a") as f:
        f.write("".join(x + "\n" for x in later))
    incs = scan(db, tmp_path / "job")
    assert [(i["kind"], i["status"]) for i in incs] == [("nan", "resolved"), ("nan", "open")]


def test_quiet_incidents_resolve_only_under_watch(tmp_path: Path, db: Path) -> None:
    log = tmp_path / "job" / "rank0.log"
    write_lines(
        log,
        [mmengine_iter_line(T0, "train", 1, 5, 10, step_time=0.5, losses={"loss": float("nan")})],
    )
    store = Store.open(db)
    try:
        pipe = Pipeline(Config(), store, [str(tmp_path / "job")], live=False)
        pipe.scan()
        assert not pipe.correlator.process(live=False, now=time.time() + 10 * 86400)
        (inc,) = list_incidents(store._conn)
        assert inc["status"] == "open"
        live = Pipeline(Config(), store, [str(tmp_path / "job")], live=True)
        changes = live.correlator.process(live=True, now=time.time() + 2 * 3600)
        assert [c.action for c in changes] == ["resolve"]
        (inc,) = list_incidents(store._conn)
        assert inc["status"] == "resolved"
        live.tracker.close()
        pipe.tracker.close()
    finally:
        store.close()


def test_show_tells_the_story(seed: tuple[TrainingRun, TrainingRun], db: Path) -> None:
    from nanwatch.render import render_story

    run_a, _ = seed
    scan(db, run_a.launch_dir)
    store = Store.open(db, readonly=True)
    try:
        inc = show_incident(store._conn, 1)
    finally:
        store.close()
    assert inc is not None
    text = render_story(inc)
    assert "Root cause:" in text and "rank 3" in text and "Known causes:" in text
    assert "$ grep" in text  # the hint's commands
    assert text.index("Root cause:") < text.index("Timeline:") < text.index("Known causes:")
