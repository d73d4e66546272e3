"""Generic detection over formats no pack names: overflow cascades, bracketed and piped
metrics, and the fields a failure takes from its own stream."""

from __future__ import annotations

from nanwatch.detect import Detector, StreamState, load_rules
from nanwatch.events import Event

DETECTOR = Detector(load_rules(), default_year=2026)


def feed(lines: list[str], state: StreamState | None = None) -> list[Event]:
    st = state if state is not None else StreamState()
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    events, _ = DETECTOR.feed(data, 0, st, "rank.log")
    return events


# --- overflow cascades ---------------------------------------------------------------------------


def _ds(scale: int, rank: int = 0) -> str:
    return (
        f"[2026-05-02 10:11:12,345] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] "
        f"OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: {scale * 2}, "
        f"reducing to {scale}"
    )


def _hysteresis(rank: int = 0) -> str:
    return (
        "[2026-05-02 10:11:13,001] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] "
        f"OVERFLOW! Rank {rank} Skipping step. Attempted loss scale: 4096, but hysteresis is 2. "
        "Reducing hysteresis to 1"
    )


def _cascades(events: list[Event]) -> list[int]:
    """The overflow runs that opened an incident: how many notices each counted."""
    assert {e.kind for e in events} <= {"overflow"}
    return [
        e.fields["consecutive_overflows"] for e in events if e.fields.get("incident") is not False
    ]


def test_a_lone_overflow_stays_quiet() -> None:
    events = feed([_ds(32768)])
    assert [e.fields.get("incident") for e in events] == [False]


STEP = "epoch 1 iter 40/500 loss: 2.113 lr: 1.0e-04"


def test_overflows_in_a_row_with_a_halving_scale_are_an_incident() -> None:
    events = feed([STEP, _ds(1 << 20), _ds(1 << 19), _ds(1 << 18), _ds(1 << 17)])
    assert _cascades(events) == [4]
    assert [e.rank for e in events if e.fields.get("incident") is not False] == [0]


def test_the_scaler_calibrating_at_start_up_stays_quiet() -> None:
    """DeepSpeed starts at 2**32 (apex and torch at 2**16) and halves until a step fits: a
    run of notices before the first iteration line is the scaler finding its level."""
    warm_up = [_ds(1 << s) for s in range(31, 23, -1)]
    assert _cascades(feed(warm_up)) == []
    assert _cascades(feed([_ds(1 << 15), _ds(1 << 14), _ds(1 << 13), _ds(1 << 12)])) == []


def test_a_start_up_fall_below_a_settled_level_is_an_incident() -> None:
    lines = [_ds(1 << s) for s in range(15, 6, -1)]  # 32768 down to 128
    assert _cascades(feed(lines)) == [6]  # at 1024, the sixth notice


def test_a_scale_fallen_sixteenfold_is_an_incident_whatever_the_wording() -> None:
    lines = [
        STEP,
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 131072.0",
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0",
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 8192.0",
    ]
    assert _cascades(feed(lines)) == [3]


def test_the_hysteresis_wording_counts_in_the_run() -> None:
    lines = [STEP, _hysteresis(), _hysteresis(), _ds(2048), _ds(1024)]
    assert _cascades(feed(lines)) == [4]


def test_a_step_between_or_another_rank_breaks_the_run() -> None:
    lines = [STEP, _ds(1 << 20), _ds(1 << 19), STEP, _ds(1 << 18), _ds(1 << 17, rank=1)]
    assert _cascades(feed(lines)) == []


def test_a_scale_that_grew_again_starts_a_new_run() -> None:
    lines = [_ds(1 << 16), _ds(1 << 15), _ds(1 << 17), _ds(1 << 16)]
    assert _cascades(feed(lines)) == []


def test_the_run_survives_the_state_round_trip() -> None:
    st = StreamState()
    feed([STEP, _ds(1 << 20), _ds(1 << 19), _ds(1 << 18)], st)
    st = StreamState.from_json(st.to_json())
    assert _cascades(feed([_ds(1 << 17)], st)) == [4]


def test_a_torch_grad_scaler_notice_counts_too() -> None:
    lines = [
        f"[WARNING] iteration {n}: found overflow, skip this step (loss scale {s})"
        for n, s in [(7, 512), (8, 256), (9, 128), (10, 64)]
    ]
    assert _cascades(feed(lines)) == [4]


def _mm(it: int, grad_norm: str) -> str:
    return (
        f"2026/05/03 10:{it // 10:02d}:00 - mmengine - INFO - Iter(train) [{it:4d}/3000]  "
        f"lr: 1.0e-04  eta: 1:00:00  time: 1.2  data_time: 0.01  memory: 9000  "
        f"loss: 0.71  grad_norm: {grad_norm}"
    )


def test_logged_steps_whose_grad_norm_stays_nan_are_one_run() -> None:
    """Each notice is a step line of its own (a skipped step, no scale named): logged steps
    that all say nan are steps skipped in a row; one finite grad norm between breaks the run."""
    nans = [_mm(it, "nan") for it in range(610, 660, 10)]
    assert _cascades([e for e in feed(nans) if e.kind == "overflow"]) == [4]
    broken = [nans[0], nans[1], _mm(630, "3.52"), nans[3], nans[4]]
    assert _cascades([e for e in feed(broken) if e.kind == "overflow"]) == []


# --- bracketed and piped metrics -----------------------------------------------------------------

_LOGURU = "2026-05-03 09:12:44.120 | INFO     | trainer.loop:fit:212 - "


def _nan(line: str) -> list[tuple[object, ...]]:
    return [
        (e.kind, e.fields.get("tensor"), e.rank, e.epoch, e.step, e.stage) for e in feed([line])
    ]


def test_a_bracketed_key_with_a_nan_value_fills_rank_epoch_step_and_stage() -> None:
    line = _LOGURU + "[R0] E6 iter[ 14/ 15] | [Loss] nan | [lr] 1.0e-04 | [step]   104 |"
    assert _nan(line) == [("nan", "Loss", 0, 6, 104, "train")]


def test_an_epoch_word_and_another_rank_are_read_the_same_way() -> None:
    line = "[R3] Epoch 4 | [Step] 310 | [Acc] inf | [time] 0.21"
    assert _nan(line) == [("nan", "Acc", 3, 4, 310, None)]


def test_piped_cells_read_a_train_line() -> None:
    line = _LOGURU + "[R2] | Epoch 3 | [step] 881 | loss: nan | grad_norm: 1.2 |"
    assert _nan(line) == [("nan", "loss", 2, 3, 881, "train")]


def test_finite_bracketed_values_and_settings_stay_quiet() -> None:
    assert (
        feed([_LOGURU + "[R0] E6 iter[ 15/ 15] | [Loss] 2.31 | [lr] 1.0e-04 | [step] 105 |"]) == []
    )
    assert feed(["[clip] inf | [max_norm] inf | [patience] inf"]) == []


# --- Ascend stream timeouts and HCCL link set-up -------------------------------------------------


def _comm(lines: list[str]) -> list[tuple[object, ...]]:
    return [(e.kind, e.rank, e.fields.get("backend"), e.fields.get("code")) for e in feed(lines)]


def test_a_stream_synchronize_timeout_is_a_collective_timeout() -> None:
    lines = [
        "[rank4]: RuntimeError: npuSynchronizeUsedDevices:torch_npu/csrc/core/npu/"
        "NPUFunctions.cpp:112 NPU function error: AclrtSynchronizeDeviceWithTimeout, "
        "error code is 507046",
        "[rank4]: [ERROR] 2026-05-04-10:20:30 (PID:5521, Device:4, RankID:4) ERR00100 PTA call "
        "acl api failed",
        "[rank4]: EE1002: [PID: 5521] 2026-05-04-10:20:30.101.220 Stream synchronize timeout, "
        "device_id=4, stream_id=3, timeout=1800000ms",
    ]
    assert [c[:3] for c in _comm(lines)] == [("comm_timeout", 4, "hccl")]


def test_a_cann_stream_timeout_report_alone_is_one_too() -> None:
    lines = [
        "EE1002: [PID: 771] 2026-05-04-10:20:30.101.220 Stream synchronize timeout, device_id=0, "
        "stream_id=2, timeout=1800000ms",
        "        rtDeviceSynchronize execute failed, reason=[stream sync timeout]",
    ]
    assert _comm(lines) == [("comm_timeout", None, "hccl", "EE1002")]


def test_an_hccl_link_failure_in_a_worker_block_is_the_workers_comm_error() -> None:
    head = "(VllmWorker rank=2 pid=611) ERROR 05-04 10:21:00 [multiproc_executor.py:470] "
    lines = [
        head + "WorkerProc failed to start.",
        head + "RuntimeError: [HCCL] Transport init error. Reason: [Create][DestLink]Create Dest "
        "error! peer rank: 6, local ip 10.0.0.2, remote ip 10.0.0.6",
        head + "    while building the link of group tp_0",
    ]
    events = feed(lines)
    assert [(e.kind, e.rank, e.fields.get("peer_rank")) for e in events] == [("comm_error", 2, "6")]


def test_a_link_timeout_naming_hccl_and_its_settings() -> None:
    line = "[W] [HCCL] socket connect timed out after 120s, peer rank: 7"
    assert _comm([line]) == [("comm_error", None, "hccl", None)]
    assert feed(["export HCCL_CONNECT_TIMEOUT=1200 HCCL_EXEC_TIMEOUT=1800"]) == []


# --- the stage and epoch a failure happened in ---------------------------------------------------


def _crash(before: list[str], frame: str, entry: str = "/code/main.py") -> list[str]:
    return [
        *before,
        "Traceback (most recent call last):",
        f'  File "{entry}", line 88, in <module>',
        "    main()",
        f'  File "/code/loop.py", line 141, in {frame}',
        "    out = model(batch)",
        "ValueError: batch has no labels",
    ]


def _where(lines: list[str]) -> list[tuple[object, ...]]:
    return [(e.kind, e.stage, e.epoch) for e in feed(lines)]


def test_a_failure_in_a_test_step_after_an_epoch_line_has_both() -> None:
    lines = _crash(["epoch 5 done, starting test"], "test_step")
    assert _where(lines) == [("process_failure", "test", 5)]


def test_an_epoch_of_so_many_at_the_head_of_a_line_fills_the_epoch() -> None:
    lines = _crash(["[3/100] step 40 loss 1.20"], "fit")
    assert _where(lines) == [("process_failure", "train", 3)]
