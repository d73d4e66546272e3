"""The metric-line reader (detect/progress.py) and what the engine takes from it."""

from __future__ import annotations

import pytest

from nanwatch.detect import progress
from nanwatch.detect.engine import Detector
from nanwatch.detect.rules import load_rules
from nanwatch.stream import StreamState


def _before(chunk: bytes, marker: bytes) -> progress.LineProgress | None:
    """What ``progress.before`` finds for the report that starts with ``marker``."""
    return progress.before(chunk, chunk.index(marker))


@pytest.mark.parametrize(
    ("line", "stage", "epoch", "it", "step"),
    [
        ("ep 4 | iter 120 | loss 0.731 | lr 1e-4", "train", 4, 120, None),
        ("Epoch 3/12  step=4410  loss=nan", "train", 3, None, 4410),
        ("train: 9, 140 / 700] Loss/total: 0.91", "train", None, 140, None),
        ("  81/400 [====>....] - ETA: 2:10 - loss: 0.5 - val_loss: 0.6", "train", None, 81, None),
        ("eval epoch 2: val loss 0.44", "val", 2, None, None),
        # the modes disagree: nanoGPT's evaluation line says both
        ("step 2000: train loss 3.91, val loss 3.97", None, None, None, 2000),
        # a JSON log whose position key names its total ("global_step/max_steps")
        (
            '{"loss": 0.8, "epoch": 0.41, "global_step/max_steps": "1310/4000"}',
            "train",
            None,
            None,
            1310,
        ),
        ('{"eval_loss": 0.6, "step": "25"}', "val", None, None, 25),
        # an aligned key/value table (HF Trainer's metrics) with a whole epoch printed as float
        ("  epoch                   =        3.0", None, 3, None, None),
        # no loss and no counter: not a metric line
        ("loading shards 3/8 [=====>  ]", None, None, None, None),
    ],
)
def test_a_metric_line_is_read_by_its_structure(
    line: str, stage: str | None, epoch: int | None, it: int | None, step: int | None
) -> None:
    got = progress.read(line)
    if line.startswith("loading"):
        assert got is not None and not got.loss
        return
    assert got is not None
    assert (got.stage, got.epoch, got.iter, got.step) == (stage, epoch, it, step)


def test_a_loss_scale_and_a_position_inside_a_counter_are_not_read() -> None:
    got = progress.read("Epoch:[2/10] loss_scale: 1024.0")
    assert got is not None and not got.loss and got.epoch == 2 and got.iter is None


@pytest.mark.parametrize(
    ("line", "stage"),
    [
        ("Epoch[7] Train-MAE=nan", "train"),
        ("Epoch[7] Validation-accuracy=nan", "val"),
        ("step 300 eval/acc: nan", "val"),
        ("images from val-2017/ read: 5000", None),
        # keys of both modes on one step's bar: the training step's (its plain-named loss)
        ("Epoch 2: 100%|#| 12/12 [00:40<00:00, training/loss=0.48, validation/loss=1.9]", "train"),
    ],
)
def test_a_metric_key_headed_by_a_mode_word_names_the_stage(line: str, stage: str | None) -> None:
    got = progress.read(line)
    assert (got.stage if got else None) == stage


def test_a_bars_share_is_no_counter() -> None:
    got = progress.read("Iteration:  42%|####2     | 655/1559 [06:01<08:19,  1.81it/s]")
    assert got is not None and got.iter == 655
    got = progress.read("Epoch:   3%|3         | 10/321 [00:41<21:30,  4.15s/it]")
    assert got is not None and got.epoch == 10 and got.iter is None


def test_a_size_that_changed_is_no_counter() -> None:
    got = progress.read("WARNING: dropped empty targets (batch 64 -> 61), loss 2.31")
    assert got is not None and got.loss and got.iter is None and not got.counted


def test_the_last_logged_step_before_a_report() -> None:
    chunk = (
        b"Epoch 7/20\n"
        b"12/90 [==>....] - loss: 0.3\n"
        b"13/90 [==>....] - loss: 0.3\n"
        b"Traceback (most recent call last):\n"
    )
    got = progress.before(chunk, chunk.index(b"Traceback"))
    assert got is not None and (got.epoch, got.iter, got.stage) == (7, 13, "train")
    # nothing below the floor is read
    at = chunk.index(b"Traceback")
    assert progress.before(chunk, at, floor=at) is None


def test_a_report_inside_a_block_takes_the_step_its_header_names() -> None:
    # one metric per line under a header that names the iteration (RL trainers, GAN loops)
    chunk = (
        b"   Learning iteration 640/5000\n"
        b"\n"
        b"      Value function loss: 0.113\n"
        b"         Surrogate loss: nan\n"
    )
    got = _before(chunk, b"         Surrogate")
    assert got is not None and got.iter == 640
    got = _before(
        b"iter 90 of 1000\n  d_loss: 0.5\n  g_loss: 0.7\n  g_loss: nan\n", b"  g_loss: nan"
    )
    assert got is not None and (got.iter, got.stage) == (90, "train")
    # a loss line with counters of its own above the block is another step's: not borrowed
    got = _before(b"iter 89 loss 0.4\n  d_loss: 0.5\n  g_loss: nan\n", b"  g_loss: nan")
    assert got is not None and got.iter is None
    # a bare position (a shard loader's bar) is no header
    bar = b"Loading checkpoint shards: 100%|#####| 4/4 [00:03<00:00]\nRuntimeError: boom\n"
    assert _before(bar, b"RuntimeError") is None


def _events(text: str) -> list:
    det = Detector(load_rules())
    events, _ = det.feed(text.encode(), 0, StreamState(), "x.log")
    return events


def test_a_report_without_counters_takes_the_step_logged_before_it() -> None:
    """A format no progress rule knows: the crash's event says where the run was."""
    (ev,) = _events(
        "[trainer] ep 3 | it 410/1000 | loss 0.2241 | lr 2.0e-4\n"
        "[trainer] ep 3 | it 420/1000 | loss 0.2203 | lr 2.0e-4\n"
        "Traceback (most recent call last):\n"
        '  File "/srv/job/run.py", line 77, in <module>\n'
        "    out = model(batch)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    assert ev.kind == "process_failure"
    assert (ev.epoch, ev.stage) == (3, "train")


def test_a_nan_on_an_unknown_metric_line_gets_its_own_counters() -> None:
    (ev,) = _events("[worker] epoch 5 iter 3100 total_loss: nan\n")
    assert (ev.kind, ev.epoch, ev.iter, ev.stage) == ("nan", 5, 3100, "train")


def test_an_inference_log_gets_no_stage() -> None:
    (ev,) = _events(
        "INFO 03-01 10:00:00 engine.py:120] Avg prompt throughput: 120.1 tokens/s\n"
        "Traceback (most recent call last):\n"
        '  File "/srv/api.py", line 40, in generate\n'
        "    out = llm.generate(prompts)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    assert ev.stage is None and ev.iter is None


@pytest.mark.parametrize(
    ("line", "train"),
    [
        ("loop.guard - Loss is nan.", True),
        ("ValueError: NaN loss", True),
        ("step skipped: grad_norm is nan", True),
        ("val_loss is nan", False),
        ("Evaluating: loss is nan", False),
        ("reward is nan", False),
    ],
)
def test_a_non_finite_loss_or_gradient_is_a_training_steps(line: str, train: bool) -> None:
    assert progress.training_value(line) is train


def test_a_nan_loss_with_no_stage_anywhere_is_trainings() -> None:
    (ev,) = _events("trainer.guard - Loss is nan.\n")
    assert ev.kind == "nan" and ev.stage == "train"
    (ev,) = _events("metrics: reward_mean: nan\n")
    assert ev.kind == "nan" and ev.stage is None


def test_a_report_just_before_a_logged_step_is_that_steps() -> None:
    """The notice comes first, the step's log line after it; nothing came before."""
    events = _events(
        "12:00:01 [W] grad scaler: overflow, scale lowered to 512.0\n"
        "12:00:01 [I] ep 2/90 | step 340/1200 | loss: nan | lr: 0.01\n"
    )
    assert events and all(e.step == 340 and e.epoch == 2 for e in events)


def test_the_look_ahead_reads_only_the_next_lines() -> None:
    chunk = b"warning\n\n\n\n\nstep 12 loss: 0.4\n"
    assert progress.after(chunk, 0) is None
    assert progress.after(chunk, 0, lines=5) is not None


def test_a_plain_loss_line_with_no_counters_names_training() -> None:
    (ev,) = _events("loss:0.6931 acc:0.5012\nloss:0.6929 acc:0.5020\nKilled\n")
    assert ev.kind == "process_failure" and ev.stage == "train" and ev.step is None


@pytest.mark.parametrize(
    ("line", "stage"),
    [
        # a learning rate beside a counter, no evaluation word: the optimizer's step
        ("Epoch 3 ; Iter 40/300 ; LR 0.5000 ; Target tokens/s 1800 ; PPL nan ;", "train"),
        ("step 20 lr=3e-4 kl=nan", "train"),
        # an evaluation word, or no counter: not told by the learning rate
        ("eval epoch 3 lr 0.1 ppl nan", "val"),
        ("lr: 0.001 ppl nan", None),
    ],
)
def test_the_stage_an_event_line_names(line: str, stage: str | None) -> None:
    assert progress.line_stage(line, progress.read(line), nonfinite=True) == stage


def test_a_notice_repeated_before_a_step_line_belongs_to_that_step() -> None:
    notice = b"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 512.0\n"
    step = b"2026-11-30 08:42:17,004 trainer INFO: iter: 340  loss: nan (nan)  lr: 0.01\n"
    got = progress.after(notice * 6 + step, 0)
    assert got is not None and got.iter == 340
    # other lines in between count: three of them and no step line is too far
    other = b"".join(f"worker {i} waiting\n".encode() for i in range(3))
    assert progress.after(notice + other + step, 0) is None


@pytest.mark.parametrize(
    ("line", "stage"),
    [
        ("step 2000: train loss nan, val loss 3.97", "train"),
        ("step 2000: train loss 3.91, val loss nan", "val"),
        ("ep=7 tr=['clean_460'] loss=nan err=0.31 valid=dev_other loss=nan err=0.95", "train"),
        ("1875/1875 - loss: nan - accuracy: 0.10 - val_loss: nan", "train"),
    ],
)
def test_a_nan_takes_the_mode_named_before_its_value(line: str, stage: str) -> None:
    """A line naming two modes: the NaN event is the first non-finite value's, and its mode is
    the nearest mode word before it (none: a plain loss, the training one)."""
    det = Detector(load_rules(), default_year=2026)
    events, _ = det.feed((line + "\n").encode(), 0, StreamState(), "x.log")
    assert [(e.kind, e.stage) for e in events] == [("nan", stage)]


def test_an_optimizer_step_report_after_a_notice_is_its_step() -> None:
    notice = b"[stage_1_and_2.py:1700:step] OVERFLOW! Rank 0 Skipping step. Attempted scale: 8192\n"
    report = b"[logging.py:69:log_dist] [Rank 0] step=512, skipped=3, lr=[0.0002, 0.0002]\n"
    got = progress.after(notice + report, 0)
    assert got is not None and got.step == 512 and got.stage == "train"
    evaluation = b"[Rank 0] eval step=512, lr=[0.0002]\n"
    assert progress.after(notice + evaluation, 0) is None


def test_a_report_after_a_bare_progress_bar_takes_its_position() -> None:
    """HF's training bar has no description; a loading bar says what it counts."""
    bare = b"  7%|\xe2\x96\x8b         | 21/300 [00:42<09:20,  2.01s/it]\n"
    loading = (
        b"Loading checkpoint shards: 100%|\xe2\x96\x88\xe2\x96\x88| 4/4 [00:03<00:00,  1.2it/s]\n"
    )
    report = b"RuntimeError: CUDA error: an illegal memory access was encountered\n"
    got = progress.before(bare + report, len(bare))
    assert got is not None and got.iter == 21 and not got.loss
    assert progress.before(loading + report, len(loading)) is None


def test_a_deep_traceback_after_a_bare_bar_still_takes_its_position() -> None:
    frames = b"".join(
        b'  File "/srv/lib/mod%d.py", line %d, in step\n    out = fn(x)\n        ^^^^^\n' % (i, i)
        for i in range(6)
    )
    bar = b"  1%|          | 9/900 [00:04<07:10,  2.07it/s]\n"
    report = b"KeyError: 'labels'\n"
    chunk = bar + b"Traceback (most recent call last):\n" + frames + report
    got = progress.before(chunk, len(chunk) - len(report))
    assert got is not None and got.iter == 9
    # the same distance in lines of the run's own log is too far for a bare bar
    other = b"".join(b"INFO: worker %d ready\n" % i for i in range(12))
    assert progress.before(bar + other + report, len(bar + other)) is None


def test_a_report_right_before_a_redrawn_bare_bar_takes_its_position() -> None:
    """tqdm redraws the bar after the step logs (HF's dict) or the exception leaves the loop."""
    report = b"{'loss': 0.93, 'grad_norm': nan, 'learning_rate': 2e-05, 'epoch': 0.03}\n\n"
    bar = b"  2%|\xe2\x96\x8f         | 30/1500 [03:10<2:35:00,  6.33s/it]\n"
    got = progress.after(report + bar, 0)
    assert got is not None and got.iter == 30
    assert progress.after(report + b"Loading shards: 100%|##| 4/4 [00:01<00:00]\n", 0) is None


def test_paddles_pass_is_an_epoch() -> None:
    got = progress.read("Pass 12, batch 340, loss 0.8812, acc1 0.71, time 0.98 sec")
    assert got is not None and (got.epoch, got.iter, got.loss) == (12, 340, True)


def test_a_metric_line_that_ends_with_its_rank() -> None:
    got = progress.read("DEBUG TRAIN Batch 410/9000 loss nan loss_ctc nan lr 0.00021 rank 5")
    assert got is not None and got.rank == 5
    got = progress.read("step 40 loss 0.3 (rank 5 of 8)")
    assert got is not None and got.rank is None


def test_a_report_before_the_first_epoch_bar_takes_the_bar_whole() -> None:
    """The bar redrawn after the report names its epoch, its position and its mode, not only
    the epoch the stream had not named yet."""
    text = (
        "lightning.fabric.utilities.exceptions.MisconfigurationException: no key 'val/acc'\n"
        "Epoch 2: 100%|\xe2\x96\x88\xe2\x96\x88| 120/120 [00:40<00:00,  2.98it/s, v_num=3]\n"
    ).encode("latin-1")
    det = Detector(load_rules(), default_year=2026)
    events, _ = det.feed(text, 0, StreamState(), "x.log")
    assert [(e.kind, e.epoch, e.iter, e.stage) for e in events] == [
        ("process_failure", 2, 120, "train")
    ]


def test_a_report_right_before_a_bar_named_by_its_mode_takes_that_mode() -> None:
    """A bar whose description is a mode word ("steps", "Validation") redrawn as the
    exception left its loop stages the report; a bar named by anything else says nothing."""
    det = Detector(load_rules(), default_year=2026)
    report = "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    for bar, stage in [
        ("steps:  13% 300/2300 [04:01<26:50,  1.24it/s, avr_loss=0.081]", "train"),
        ("Validation: 40%|####      | 4/10 [00:01<00:02,  2.90it/s]", "val"),
        ("Downloading:  40%|####      | 4/10 [00:01<00:02,  2.90it/s]", None),
    ]:
        events, _ = det.feed((report + bar + "\n").encode(), 0, StreamState(), "x.log")
        assert [(e.kind, e.stage) for e in events] == [("process_failure", stage)], bar


def test_a_source_file_named_loss_is_no_loss_value() -> None:
    """A kernel's file ("Loss.cu:257") names no loss: the failure gets no training stage."""
    assert progress.read("/src/aten/src/ATen/native/cuda/Loss.cu:257: nll_loss_forward") is None
    assert progress.read("/srv/exp/loss.py:40: UserWarning: reduction is deprecated") is None
    got = progress.read("epoch 3 loss.total: 0.91")
    assert got is not None and got.loss


def test_the_position_beside_its_percentage_in_brackets() -> None:
    """The loop of PyTorch's examples: "Train Epoch: 3 [640/60000 (1%)]\tLoss: 0.51"."""
    got = progress.read("Train Epoch: 3 [640/60000 (1%)]\tLoss: 0.512300")
    assert got is not None and (got.epoch, got.iter, got.loss) == (3, 640, True)


def test_a_header_with_a_learning_rate_beside_its_counter_is_trainings() -> None:
    """ "Running epoch=3  lr=0.0001" before a report: the epoch, in training; a header with
    no learning rate names no mode."""
    got = _before(b"Running epoch=3\tlr=0.00010\nFailed to allocate again.\n", b"Failed")
    assert got is not None and (got.epoch, got.stage) == (3, "train")
    got = _before(b"Learning iteration 8391/10000\nFailed to allocate again.\n", b"Failed")
    assert got is not None and got.stage is None


def test_a_bar_counting_epochs_names_the_epoch() -> None:
    got = progress.read(" 65%|######5   | 98/150 [18:47:34<9:58:18, 690.35s/epoch, loss=-1.01]")
    assert got is not None and (got.epoch, got.iter) == (98, None)
    got = progress.read(" 65%|######5   | 98/150 [00:47<00:18,  2.07it/s, loss=1.01]")
    assert got is not None and (got.epoch, got.iter) == (None, 98)


def test_a_total_step_counter_and_a_banner_after_dashes() -> None:
    got = progress.read("epoch 0, total_step 90260, total loss is 15.06 , training accuracy 0.31")
    assert got is not None and (got.epoch, got.step) == (0, 90260)
    assert progress.read("total_steps: 100000") is None  # a setting, not a position
    got = progress.read("----------------EPOCH 3")
    assert got is not None and got.epoch == 3


def test_the_step_line_right_after_a_report_names_its_rank() -> None:
    (ev,) = [
        e
        for e in _events(
            "[2026-03-02 10:00:01,100][root][WARNING] - grad norm is nan, update skipped\n"
            "[2026-03-02 10:00:01,104][root][INFO] - train, rank: 2, epoch: 1/10, "
            "total step: 40, (loss_avg: 3.21)\n"
        )
        if e.kind == "nan"
    ]
    assert (ev.rank, ev.epoch) == (2, 1)
    assert progress.read("train, rank: 2, epoch: 1/10, total step: 40, loss: 3.2").rank == 2
    assert progress.read("epoch: 1, local_rank: 3, loss: 3.2").rank is None


def test_a_line_wrapped_after_its_loss_takes_the_counters_on_the_next_line() -> None:
    chunk = (
        b"Train: 2026-01-02 10:00:01-Speed 812.5 samples/sec   Loss nan   LR 0.1000   \n"
        b"Epoch: 3   Global Step: 120   Required: 9 hours\n"
        b"Train: 2026-01-02 10:00:05-Speed 815.0 samples/sec   Loss nan   LR 0.1000   "
        b"Epoch: 3   Global Step: 130   Required: 9 hours\n"
    )
    got = progress.after(chunk, 0)
    assert got is not None and (got.epoch, got.step) == (3, 120)
    # not wrapped: the counters on the next line are another record's
    unwrapped = chunk.replace(b"LR 0.1000   \n", b"LR 0.1000\n", 1)
    got = progress.after(unwrapped, 0)
    assert got is None or got.step != 120


def test_a_repeated_notice_does_not_lend_its_step_to_the_first() -> None:
    """Two NaN notices fold into one report; the first says where the run first went NaN."""
    events = [
        e
        for e in _events(
            "[2026-03-02 10:00:01,100][root][WARNING] - grad norm is nan, update skipped\n"
            "[2026-03-02 10:00:01,104][root][INFO] - train, rank: 1, epoch: 2, "
            "total step: 40, (loss_avg: 3.21)\n"
            "[2026-03-02 10:00:02,800][root][WARNING] - grad norm is nan, update skipped\n"
            "[2026-03-02 10:00:02,804][root][INFO] - train, rank: 1, epoch: 2, "
            "total step: 41, (loss_avg: 3.19)\n"
        )
        if e.kind == "nan"
    ]
    assert (events[0].step, events[0].rank) == (40, 1)
