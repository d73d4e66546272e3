"""``NanwatchHook``: the in-process companion for mmengine runners (mmdet 3.x, mmpretrain, ...).

Two lines in a config turn it on::

    custom_imports = dict(imports=['nanwatch.integrations.mmengine'], allow_failed_imports=False)
    custom_hooks = [dict(type='NanwatchHook')]

Importing this module registers the hook in mmengine's ``HOOKS`` registry. Each rank then
prints its facts once (``NANWATCH-FACTS``), one ``NANWATCH-DATA`` line per training sample whose
``gt_instances.labels`` is empty (with ``metainfo['img_path']``/``img_id``, rate-limited),
markers around validation and testing (``NANWATCH-STAGE``) and, after an uncaught exception,
the device memory summary (``NANWATCH-MEMORY``). Lines go through the runner's logger (its log
file) and stderr (every rank's captured output); see ``nanwatch.probe``.
"""

from __future__ import annotations

from typing import Any

from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from ..probe import Probe

__all__ = ["NanwatchHook"]


@HOOKS.register_module()
class NanwatchHook(Hook):  # type: ignore[misc]
    """Prints what only the training process knows, for nanwatch to read.

    Args:
        lines_per_minute: data lines allowed per minute once ``burst`` lines are spent; findings
            beyond it are counted and the next line says how many were left out.
        burst: data lines allowed at once.
        check_data: look for samples with empty ground truth on every training iteration.
    """

    priority = "NORMAL"

    def __init__(
        self, lines_per_minute: float = 60.0, burst: int = 100, check_data: bool = True
    ) -> None:
        self.lines_per_minute = lines_per_minute
        self.burst = burst
        self.check_data = check_data
        self.probe: Probe | None = None
        self._by_epoch = True

    # -- run ------------------------------------------------------------------------------------

    def before_run(self, runner: Any) -> None:
        self.probe = Probe(
            logger=runner.logger,
            rank=int(runner.rank),
            lines_per_minute=self.lines_per_minute,
            burst=self.burst,
        )
        self._by_epoch = bool(getattr(getattr(runner, "log_processor", None), "by_epoch", True))
        randomness = dict(getattr(runner, "_randomness_cfg", None) or {})
        determinism = {
            "seed": runner.seed,
            "deterministic": randomness.get("deterministic"),
            "diff_rank_seed": randomness.get("diff_rank_seed"),
        }
        self.probe.announce(
            work_dir=runner.work_dir,
            extra={
                "world_size": int(runner.world_size),
                "launcher": runner.launcher,
                "determinism": determinism,
            },
        )
        self.probe.install_excepthook()

    def after_run(self, runner: Any) -> None:
        if self.probe is not None:
            self.probe.uninstall_excepthook()

    # -- training -------------------------------------------------------------------------------

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        if self.probe is None or not self.check_data or data_batch is None:
            return
        step = int(runner.iter) + 1  # what the log line of this iteration will call it
        if self._by_epoch:
            self.probe.check_batch(
                data_batch, epoch=int(runner.epoch) + 1, iter=batch_idx + 1, step=step
            )
        else:
            self.probe.check_batch(data_batch, iter=step, step=step)

    def after_train(self, runner: Any) -> None:
        if self.probe is not None:
            self.probe.emit(
                "STAGE",
                {
                    "rank": self.probe.rank,
                    "stage": "train",
                    "event": "end",
                    "empty_samples": self.probe.empty_samples,
                    "suppressed": self.probe.suppressed,
                },
            )

    # -- validation and testing -----------------------------------------------------------------

    def before_val_epoch(self, runner: Any) -> None:
        if self.probe is not None:
            self.probe.stage("val", "start", epoch=int(runner.epoch), iter=int(runner.iter))

    def after_val_epoch(self, runner: Any, metrics: dict[str, float] | None = None) -> None:
        if self.probe is not None:
            self.probe.stage("val", "end", epoch=int(runner.epoch), iter=int(runner.iter))

    def before_test_epoch(self, runner: Any) -> None:
        if self.probe is not None:
            self.probe.stage("test", "start")

    def after_test_epoch(self, runner: Any, metrics: dict[str, float] | None = None) -> None:
        if self.probe is not None:
            self.probe.stage("test", "end")
