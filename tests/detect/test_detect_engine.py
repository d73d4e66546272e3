"""The detection engine on text as it really arrives: failure reports over several lines and
chunks, interleaved ranks, progress bars, colours, wrapped lines, GBK bytes, metrics."""

from __future__ import annotations

import copy
from pathlib import Path

from nanwatch.demo.simulate import TrainingRun
from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.events import Event, Metric

DETECTOR = Detector(load_rules(), default_year=2026)

HCCL_BLOCK = [
    "[rank5]: Traceback (most recent call last):",
    '[rank5]:   File "/opt/mmengine/runner/loops.py", line 107, in run',
    '[rank5]:   File "/opt/torch/distributed/distributed_c10d.py", line 2501, in all_reduce',
    "[rank5]:     work = group.allreduce([tensor], opts)",
    "[rank5]: RuntimeError: InnerRunOpApi:torch_npu/csrc/framework/OpParamMaker.cpp:281 OPS "
    "function error: HcclAllreduce, error code is 6",
    "[rank5]: [ERROR] 2026-03-02-10:01:02 (PID:4242, Device:5, RankID:5) ERR01100 OPS call acl "
    "api failed.",
    "[rank5]: EI0002: [PID: 4242] 2026-03-02-10:01:02.444.436 The wait execution of the Notify "
    "register times out. Reason: The Notify register has not received the Notify record from "
    "remote rank: [6]. base information: [streamID:[3], taskID[81], taskType[Notify Wait], "
    "tag[AllReduce_group_name_3]].",
    "[rank5]:         Possible Cause: 1. An exception occurs during the execution on some NPUs.",
]


def feed(lines: list[str], state: StreamState | None = None) -> tuple[list[Event], list[Metric]]:
    st = state if state is not None else StreamState()
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    return DETECTOR.feed(data, 0, st, "rank.log")


def test_a_failure_report_is_one_event_with_the_strongest_line() -> None:
    events, _ = feed(HCCL_BLOCK)
    assert len(events) == 1
    ev = events[0]
    assert ev.kind == "comm_timeout"
    assert ev.rank == 5
    assert ev.line == 5  # where the report's first detection is
    assert ev.fields["code"] == "EI0002"
    assert ev.fields["remote_rank"] == 6
    assert ev.fields["op"] == "AllReduce"  # the strongest line's fields win
    assert ev.fields["backend"] == "hccl"
    assert "EI0002" in ev.message


def test_a_report_split_over_two_chunks_stays_one_failure() -> None:
    state = StreamState()
    first, _ = feed(HCCL_BLOCK[:5], state)
    assert [e.kind for e in first] == ["comm_error"]
    # the pipeline persists the state between chunks as JSON
    state = StreamState.from_json(state.to_json())
    second, _ = feed(HCCL_BLOCK[5:], state)
    # the timeout line is stronger and of another kind: it is kept; nothing else is added
    assert [e.kind for e in second] == ["comm_timeout"]
    third, _ = feed(
        ["[rank5]: EI0002: The wait execution of the Notify register times out."], state
    )
    assert third == []


def test_a_line_that_opens_as_the_one_before_it_is_never_its_wrapped_tail() -> None:
    # a serving worker's logger prefix on every line: the second line is a record of its own
    # (here the report's timeout), not the rest of the first
    head = "(EngineCore_0 dp=2 pid=7310) ERROR 11-30 08:42:17 [core.py:411] "
    events, _ = feed(
        [
            head + "[ERROR] 2026-11-30-08:42:17 (PID:7310, Device:2, RankID:-1) ERR00100 PTA "
            "call acl api failed",
            head + "[Error]: The execution of the internal task times out.",
        ]
    )
    assert [e.kind for e in events] == ["comm_timeout"]
    assert "ERROR 11-30" not in events[0].message
    # a long line whose tail the terminal wrapped is still read whole
    wrapped, _ = feed(
        [
            "[rank4]:[E1130 08:42:17.004118 ProcessGroupNCCL.cpp:632] [Rank 4] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=77, OpType=ALLGATHER, Timeout(ms)=90",
            "0000) ran for 900410 milliseconds before timing out.",
        ]
    )
    assert [e.kind for e in wrapped] == ["comm_timeout"]
    assert wrapped[0].fields["timeout_ms"] == 900000
    assert wrapped[0].rank == 4
    # the detection's words on the tail only: the rank is the wrapped line's
    tail, _ = feed(
        [
            "[rank11]:[E1130 08:42:17.004118 ProcessGroupNCCL.cpp:1701] [PG ID 0 PG GUID 0(defau"
            "lt_pg) Rank 11] ProcessGroupNCCL'",
            "s watchdog got stuck for 300 seconds without making progress in monitoring enqueued "
            "collectives.",
        ]
    )
    assert [(e.kind, e.rank) for e in tail] == [("comm_timeout", 11)]
    # a short line before is no wrapped line: its prefix is not lent
    short, _ = feed(
        [
            "[rank2]: step 10",
            "ProcessGroupNCCL's watchdog got stuck for 300 seconds without making progress in "
            "monitoring enqueued collectives.",
        ]
    )
    assert [(e.kind, e.rank) for e in short] == [("comm_timeout", None)]


def test_interleaved_ranks_and_iterations_are_separate_events() -> None:
    events, _ = feed(
        [
            "[rank0]:[E321 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=15, OpType=ALLREDUCE, NumelIn=8, "
            "NumelOut=8, "
            "Timeout(ms)=600000) ran for 600060 milliseconds before timing out.",
            "[rank4]:[E321 02:07:08.414 ProcessGroupNCCL.cpp:607] [Rank 4] Watchdog caught "
            "collective operation timeout: WorkNCCL(SeqNum=15, OpType=ALLREDUCE, NumelIn=8, "
            "NumelOut=8, "
            "Timeout(ms)=600000) ran for 600067 milliseconds before timing out.",
            "[rank0]:[E321 02:07:08.465 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 0] Exception "
            "(either an error or timeout) detected by watchdog at work: 15, last enqueued NCCL "
            "work: 16, last "
            "completed NCCL work: 14.",
        ]
    )
    assert [(e.kind, e.rank) for e in events] == [("comm_timeout", 0), ("comm_timeout", 4)]
    assert events[0].fields["last_completed"] == "14"
    events, _ = feed(
        [
            "2026-11-30 10:00:05,100 - mmdet - INFO - Epoch [1][10/50]\tlr: 1.0e-04, eta: 0:10:00, "
            "time: 0.5, data_time: 0.01, memory: 1000, loss_cls: nan, loss: nan",
            "2026-11-30 10:00:10,100 - mmdet - INFO - Epoch [1][20/50]\tlr: 1.0e-04, eta: 0:10:00, "
            "time: 0.5, data_time: 0.01, memory: 1000, loss_cls: nan, loss: nan",
        ]
    )
    assert [(e.kind, e.iter) for e in events] == [("nan", 10), ("nan", 20)]


def test_stage_from_frames_banners_and_bars_and_none_by_default() -> None:
    events, _ = feed(["RuntimeError: CUDA error: out of memory"])
    assert events[0].stage is None  # nothing names one: not a silent "train"
    events, _ = feed(
        [
            "***** Running Evaluation *****",
            "  Num examples = 500",
            "RuntimeError: CUDA error: out of memory",
        ]
    )
    assert events[0].stage == "val"
    # a traceback hint does not outlive the next iteration line
    state = StreamState()
    feed(['  File "x.py", line 3, in val_step', "ValueError: bad shape"], state)
    events, _ = feed(
        [
            "2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [2][5/10]  lr: 1.0e-04  "
            "eta: 0:00:10  time: 0.5  data_time: 0.01  memory: 100  loss: 1.0",
            "RuntimeError: CUDA error: out of memory",
        ],
        state,
    )
    assert (events[0].stage, events[0].epoch, events[0].iter) == ("train", 2, 5)


OOM = "RuntimeError: CUDA error: out of memory"
FRAMES = {
    "mmengine ValLoop.run": (
        [
            '  File "/m/mmengine/runner/loops.py", line 373, in run',
            "    self.runner.val_loop.run()",
        ],
        "val",
    ),
    "mmengine test_step": (['  File "/m/base_model.py", line 145, in test_step'], "test"),
    "Lightning validation_step": (['  File "/w/model.py", line 88, in validation_step'], "val"),
    "Lightning _evaluation_loop": (
        [
            '  File "/l/trainer/trainer.py", line 1029, in _run_stage',
            "    return self._evaluation_loop.run()",
        ],
        "val",
    ),
    "Lightning predict_step": (['  File "/w/model.py", line 12, in predict_step'], "test"),
    "HF evaluate": (['  File "/t/trainer.py", line 3011, in evaluate'], "val"),
    "HF prediction_step": (['  File "/t/trainer.py", line 4271, in prediction_step'], "val"),
    "HF evaluation_loop": (['  File "/t/trainer.py", line 3200, in evaluation_loop'], "val"),
    "Megatron evaluate(": (
        [
            '  File "/mg/training.py", line 1500, in evaluate_and_print_results',
            "    total_loss_dict, collected, timelimit = evaluate(",
        ],
        "val",
    ),
    "detectron2": (['  File "/d/evaluator.py", line 158, in inference_on_dataset'], "val"),
    "test.py": (['  File "tools/test.py", line 12, in <module>'], "test"),
    "eval.py": (['  File "/w/eval.py", line 30, in <module>'], "val"),
    "inference server": (['  File "/srv/inference_server.py", line 9, in <module>'], "test"),
    "train.py": (['  File "/w/tools/train.py", line 9, in <module>'], "train"),
    "a library frame": (['  File "/t/nn/modules/module.py", line 1501, in _call_impl'], None),
}


def test_stage_from_the_frames_of_each_framework_and_the_entry_script() -> None:
    got = {}
    for name, (frames, _) in FRAMES.items():
        events, _ = feed(["Traceback (most recent call last):", *frames, OOM])
        got[name] = events[0].stage
    assert got == {name: stage for name, (_, stage) in FRAMES.items()}


def test_an_entry_script_never_replaces_a_loop_frame() -> None:
    frames = [
        '  File "/w/tools/train.py", line 9, in <module>',
        '  File "/m/base_model.py", line 133, in val_step',
    ]
    events, _ = feed(["Traceback (most recent call last):", *frames, OOM])
    assert events[0].stage == "val"
    # IPython order: the error first, then the frames; the loop frame still wins
    events, _ = feed([f"[rank1]: {OOM}", *(f"[rank1]: {f}" for f in frames)])
    assert events[0].stage == "val"


RANKS = {
    "torchrun": ([f"[rank3]: {OOM}"], 3),
    "torchrun role": ([f"[default3]:{OOM}"], 3),
    "HCCL plog rankId": (
        [
            "[ERROR] HCCL(4242,python):2026-03-02-10:01:02.444.436 [hccl_communicator.cc:812]"
            "[4242][Init][Result]HcclCommInitRootInfo failed, rankId 3, rankSize 8, "
            "errNo[0x0000000005000004]"
        ],
        3,
    ),
    "torch_npu RankID": (
        [
            "[ERROR] 2026-03-02-10:01:02 (PID:4242, Device:3, RankID:3) ERR01100 OPS call acl",
            "EI0002: [PID: 4242] 2026-03-02-10:01:02.444.436 The wait execution of the Notify "
            "register times out.",
        ],
        3,
    ),
    "local_rank key": (["[E ProcessGroupHCCL.cpp:488] local_rank: 2, work pending", OOM], 2),
    "DeepSpeed [Rank 3]": (
        [f"[2026-03-02 10:01:02,444] [ERROR] [engine.py:1920:step] [Rank 3] {OOM}"],
        3,
    ),
    "vLLM worker": (
        [f"(VllmWorker rank=2 pid=81234) ERROR 03-02 10:01:02 [executor.py:470] {OOM}"],
        2,
    ),
    "Ray actor named by its rank": ([f"(PolicyWorker_rank3 pid=7001, ip=10.0.0.9) {OOM}"], 3),
    "Ray worker that said its rank earlier": (
        [
            "(RayWorkerWrapper pid=5012, ip=10.0.0.5) INFO [parallel_state.py:1004] rank=2 "
            "local_rank=2 world_size=4",
            "(RayWorkerWrapper pid=5013, ip=10.0.0.5) INFO [parallel_state.py:1004] rank=3 "
            "local_rank=3 world_size=4",
            f"(RayWorkerWrapper pid=5012, ip=10.0.0.5) ERROR [worker_base.py:620] {OOM}",
        ],
        2,
    ),
    "[worker3]": ([f"[worker3] {OOM}"], 3),
    "a traceback whose first lines carry the prefix": (
        [
            "[rank6]: Traceback (most recent call last):",
            '[rank6]:   File "/w/train.py", line 88, in <module>',
            "    loss.backward()",
            OOM,
        ],
        6,
    ),
    "a report head whose rank is unknown (RankID:-1)": (
        [
            "(Worker_TP3 pid=4242) [ERROR] 2026-03-02-10:01:02 (PID:4242, Device:3, RankID:-1) "
            "ERR00100 PTA call acl api failed."
        ],
        None,
    ),
    "a peer's rank is not the reporter's": (
        ["[W socket.cpp:663] [c10d] connect to peer failed, remote rank=5", OOM],
        None,
    ),
}


def test_rank_from_every_launcher_and_library_prefix_or_key() -> None:
    got = {}
    for name, (lines, _) in RANKS.items():
        events, _ = feed(lines)
        got[name] = [e.rank for e in events]
    assert got == {name: [rank] for name, (_, rank) in RANKS.items()}


def test_a_record_rank_is_lent_once_and_a_pid_keeps_its_rank_across_chunks() -> None:
    state = StreamState()
    events, _ = feed(["[rank6]: Traceback (most recent call last):", OOM, OOM], state)
    assert [e.rank for e in events] == [6]  # the second OOM is folded into the same report
    state = StreamState()
    feed(
        ["(RayWorkerWrapper pid=5012, ip=10.0.0.5) INFO worker.py:120] rank=2 world_size=4"], state
    )
    copy_ = StreamState.from_json(state.to_json())  # a restart resumes with what it learnt
    events, _ = feed([f"(RayWorkerWrapper pid=5012, ip=10.0.0.5) {OOM}"] * 1, copy_)
    assert [e.rank for e in events] == [2]


def test_zero_based_epochs_never_give_negative_steps() -> None:
    state = StreamState()
    line = "[01:34:12.610327] Epoch: [{e}]  [10/1504]  lr: 0.000001  loss: 1.5367 (1.5368)"
    feed([line.format(e=0)], state)
    assert (state.epoch, state.iter, state.step) == (0, 10, 10)
    feed([line.format(e=1)], state)
    assert state.step == 1514
    # mmengine counts epochs from 1
    state = StreamState()
    feed(
        [
            "2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [1][10/16]  lr: 1.0e-04  "
            "eta: 0:00:10  time: 0.5  data_time: 0.01  memory: 100  loss: 1.0"
        ],
        state,
    )
    assert state.step == 10


def test_progress_bars_glued_with_carriage_returns() -> None:
    bar = (
        "Epoch 3:  10%|█         | 10/100 [00:02<00:18, loss=0.52]\r"
        "Epoch 3:  20%|██        | 20/100 [00:04<00:16, loss=nan]\r"
        "Validation DataLoader 0:  50%|█████     | 5/10 [00:01<00:01]"
    )
    state = StreamState()
    events, _ = feed([bar], state)
    assert [e.kind for e in events] == ["nan"]
    assert state.stage == "val"  # the last update is where the run is now
    assert state.epoch == 3


def test_ansi_colours_gbk_and_broken_bytes() -> None:
    state = StreamState()
    data = (
        b"\x1b[31m[rank2]: RuntimeError: NPU out of memory.\x1b[0m\n"
        + "训练损失: loss: nan\n".encode("gbk")
        + b"\xff\xfe garbage \xc3\x28 loss=inf\n"
    )
    events, _ = DETECTOR.feed(data, 100, state, "x.log")
    # the two non-finite prints one line apart are one report
    assert [(e.kind, e.rank) for e in events] == [("oom", 2), ("nan", None)]
    assert events[1].message == "loss is inf"  # the later line of a report has the last word
    assert events[0].offset == 100
    assert "\x1b" not in events[0].message
    assert state.line_no == 3


def test_lines_of_no_interest_only_count() -> None:
    state = StreamState()
    lines = [f"INFO step {i} done, all good" for i in range(1000)]
    events, metrics = feed(lines, state)
    assert (events, metrics, state.line_no) == ([], [], 1000)


def test_a_shallow_copy_of_the_state_is_never_changed() -> None:
    state = StreamState()
    feed(HCCL_BLOCK[:5], state)
    before = state.to_json()
    work = copy.copy(state)  # what the pipeline does for an unterminated last line
    feed(HCCL_BLOCK[5:], work)
    assert state.to_json() == before


def test_metrics_of_hf_and_megatron_lines() -> None:
    _, metrics = feed(
        [
            "{'loss': 1.2, 'grad_norm': 3.5, 'learning_rate': 2e-05, 'epoch': 0.1}",
            " [2026-01-01 10:00:00] iteration      300/   1000 | consumed samples:  9600 | elapsed "
            "time per iteration (ms): 1520.5 | learning rate: 3.0E-04 | global batch size:  32 | "
            "lm loss: 2.5E+00 | loss scale: 1.0 | grad norm: 0.9 | number of skipped iterations:   "
            "0 | number of nan iterations:   0 |",
        ]
    )
    assert [(m.loss, m.grad_norm, m.lr) for m in metrics] == [(1.2, 3.5, 2e-05), (2.5, 0.9, 3e-4)]
    assert metrics[1].step == 300
    assert metrics[1].step_time == 1.5205


def test_healthy_lines_of_every_family_stay_clean() -> None:
    healthy = [
        " iteration      182/  250000 | lm loss: 2.382640E+00 | loss scale: 1.0 | grad norm: 0.227 "
        "| number of skipped iterations:   0 | number of nan iterations:   0 |",
        "WARNING:tensorboardX.x2num:NaN or Inf found in input tensor.",
        "[01:34:58.290992] Epoch: [0]  [20/1504]  lr: 0.000000  closs: 1.5362 (1.5382)  time: 4.5",
        "host-1:1234:5678 [0] NCCL INFO Channel 00/02 :    0   1   2   3",
        "host-1:1234:5678 [0] NCCL INFO comm 0x5581 rank 0 nranks 8 cudaDev 0 busId 1000 - Init "
        "COMPLETE",
        "dist_cfg = dict(backend='hccl', timeout=1800)",
        "export HCCL_CONNECT_TIMEOUT=1200 HCCL_EXEC_TIMEOUT=1800",
        "logging_nan_inf_filter=True,",
        "2024/08/26 16:38:23 - mmengine - INFO - Epoch(train)  [1][200/953]  lr: 1.0043e-03  "
        "eta: 5:34:07  time: 0.5117  data_time: 0.0025  memory: 5483  grad_norm: 227.8793  "
        "loss: 4.6860",
        "[2023-09-14 10:37:59,763] torch.distributed.run: [WARNING] Setting OMP_NUM_THREADS "
        "environment variable for each process to be 1 in default",
        "  fp16.loss_scale ................ 0",
        "Best val loss: inf -> 0.532, saving checkpoint",
        "torch.distributed.elastic.agent.server.api: [INFO] Done waiting for other agents. "
        "Elapsed: 0.0012 seconds",
        "Epoch 36/300, Step 4/4, step time: 23882.45 ms",
    ]
    events, _ = feed(healthy)
    assert events == []


def test_without_the_automaton_the_regex_prefilter_finds_the_same() -> None:
    slow = Detector(load_rules(), default_year=2026, automaton=False)
    lines = [
        *HCCL_BLOCK,
        "{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.5}",
        "2026/11/30 10:00:00 - mmengine - INFO - Epoch(val)  [2][5/10]    eta: 0:00:10  time: 0.5",
        "RuntimeError: CUDA error: out of memory",
    ]
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    fast_events, fast_metrics = DETECTOR.feed(data, 0, StreamState(), "x")
    slow_events, slow_metrics = slow.feed(data, 0, StreamState(), "x")
    assert [e.kind for e in fast_events] == ["comm_timeout", "nan", "oom"]
    assert slow_events == fast_events
    assert repr(slow_metrics) == repr(fast_metrics)  # nan != nan


def test_healthy_iteration_lines_never_reach_the_line_rules(tmp_path: Path) -> None:
    """The literal prefilter keeps the per-line work for metric lines only (speed guard)."""
    run = TrainingRun(tmp_path, ranks=1, epochs=3, iters=40, nan_at=None)
    data = run.write()[0].read_bytes()
    lines = data.count(b"\n")
    candidates, chunk_hits = DETECTOR._c.scan(data)
    assert len(chunk_hits) >= 120  # every iteration line reaches its chunk rule...
    # ...and (nearly) nothing else is looked at, once the environment report (run facts) is over
    body = data.index(b"Epoch(train)")
    assert len([s for s in candidates if s > body]) <= 0.05 * lines
    events, metrics = DETECTOR.feed(data, 0, StreamState(), "rank0.log")
    assert events == []
    assert len(metrics) == 120


def test_a_line_that_prints_a_learning_rate_is_a_training_step() -> None:
    """The event's own line names the stage when nothing else in the stream does."""

    def stage_of(line: str) -> str | None:
        events, _ = DETECTOR.feed((line + "\n").encode(), 0, StreamState(), None)
        assert events, line
        return events[0].stage

    assert (
        stage_of("2026-03-02 11:20:45,118-INFO: step: 40, lr: 0.000085, 'loss': 'nan'") == "train"
    )
    assert stage_of(
        "[2026-03-02 11:20:45] Train epoch: 2, batch: 90/1200, loss: nan, lr: 1e-4"
    ) == ("train")
    # no learning rate on the line: the stage stays unknown, never a silent train
    assert stage_of("2026-03-02 11:20:45 | INFO | epoch 3 | acc: nan | f1: 0.412") is None
    # an evaluation's own line says so, and no learning rate makes it a training step
    assert stage_of("{'eval_loss': nan, 'eval_accuracy': 0.41, 'epoch': 2.0}") == "val"
