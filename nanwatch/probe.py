"""In-process companion: facts only the training process knows, printed as log lines.

The daemon reads what a job prints. This module, called from the training loop, prints what
the job would not: its rank and world size, the job's identity across nodes, the versions of
torch, torch_npu and CANN, the collective timeouts in force, and the training samples whose
ground truth is empty. Each record is one line, a fixed prefix and compact JSON::

    NANWATCH-FACTS {"v":1,"rank":0,"world_size":8,"versions":{"cann":"8.0.RC2",...},...}
    NANWATCH-DATA {"reason":"empty ground truth","image":"data/coco/...jpg","image_id":139,...}
    NANWATCH-STAGE {"stage":"val","event":"start",...}
    NANWATCH-MEMORY {"exception":"OutOfMemoryError: ...","oom":true,"allocated":...,...}

A plain PyTorch / HF / DeepSpeed loop::

    from nanwatch import probe
    probe.announce(work_dir=out_dir)                  # once per rank, after dist init
    probe.install_excepthook()                        # memory summary if the process dies
    for epoch in range(epochs):
        for i, batch in enumerate(loader):
            probe.check_batch(batch, epoch=epoch + 1, iter=i + 1)

mmengine jobs use ``nanwatch.integrations.mmengine.NanwatchHook`` instead. Nothing here syncs a
device or copies a tensor: ground truth is judged by its element count (metadata), and
torch / torch_npu are only looked at when the job has imported them already.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from .integrations.probe_facts import collect_facts, memory_stats

__all__ = [
    "PREFIX",
    "Probe",
    "announce",
    "check_batch",
    "collect_facts",
    "default",
    "encode",
    "install_excepthook",
    "memory_summary",
    "stage",
]

PREFIX = "NANWATCH-"
VERSION = 1
EMPTY_GT = "empty ground truth"
EMPTY_BATCH = "empty batch"
BATCH_IMAGES = 8  # images named on an empty-batch line
_LABEL_KEYS = ("gt_labels", "labels", "class_labels")
_IMAGE_KEYS = ("img_path", "file_name", "filename", "ori_filename", "image_path", "path")
_ID_KEYS = ("img_id", "image_id", "id")
# JSON leaves these unescaped, yet some readers split lines on them
_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"}


def encode(kind: str, payload: Mapping[str, Any]) -> str:
    """One record as one line: ``NANWATCH-<KIND> {compact json}``."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, default=str)
    for ch, esc in _LINE_BREAKS.items():
        if ch in text:
            text = text.replace(ch, esc)
    return f"{PREFIX}{kind} {text}"


class _Bucket:
    """Token bucket: ``burst`` lines at once, then ``rate`` lines per second."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.clock = clock
        self.last = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Probe:
    """Prints the records of one training process.

    ``logger``: the framework's logger (its file is what nanwatch often follows); lines also go
    to ``stream`` (stderr) unless the logger already prints them on the console, so a captured
    stdout+stderr never holds a record twice. ``lines_per_minute``/``burst`` bound the data lines,
    refilled on ``clock`` (monotonic seconds).
    """

    def __init__(
        self,
        *,
        logger: logging.Logger | None = None,
        stream: TextIO | None = None,
        rank: int | None = None,
        lines_per_minute: float = 60.0,
        burst: int = 100,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.stream = stream
        self.rank = rank
        self.stage_now: str | None = None  # what the loop marked; none before it says
        self.empty_samples = 0
        self.suppressed = 0
        self.lines = 0  # records printed
        self._bucket = _Bucket(lines_per_minute / 60.0, burst, clock)
        self._console: bool | None = None
        self._lock = threading.Lock()
        self._prev_hook: Callable[..., Any] | None = None

    # -- output ----------------------------------------------------------------------------------

    def emit(self, kind: str, payload: Mapping[str, Any]) -> str:
        line = encode(kind, payload)
        with self._lock:
            self.lines += 1
            if self.logger is not None:
                self.logger.info(line)
                if self._logger_console():
                    return line
            out = self.stream if self.stream is not None else sys.stderr
            try:
                out.write(line + "\n")
                out.flush()
            except (OSError, ValueError):  # a closed stream must not break training
                pass
        return line

    def _logger_console(self) -> bool:
        """Does the logger print INFO lines on stdout/stderr itself (mmengine's rank 0 does)?"""
        if self._console is None:
            lg: logging.Logger | None = self.logger
            found = False
            while lg is not None and not found:
                for h in lg.handlers:
                    if (
                        isinstance(h, logging.StreamHandler)
                        and not isinstance(h, logging.FileHandler)
                        and h.level <= logging.INFO
                        and getattr(h, "stream", None) in (sys.stdout, sys.stderr)
                    ):
                        found = True
                lg = lg.parent if lg.propagate else None
            enabled = self.logger is not None and self.logger.isEnabledFor(logging.INFO)
            self._console = found and enabled
        return self._console

    # -- records ---------------------------------------------------------------------------------

    def announce(
        self, *, work_dir: str | None = None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Print this process's facts (call once per rank, after the process group exists)."""
        facts = collect_facts(work_dir=work_dir, extra=extra)
        if self.rank is None and isinstance(facts.get("rank"), int):
            self.rank = facts["rank"]
        elif self.rank is not None:
            facts.setdefault("rank", self.rank)
        self.emit("FACTS", {"v": VERSION, "t": _now(), **facts})
        return facts

    def stage(
        self, stage: str, event: str, *, epoch: int | None = None, iter: int | None = None
    ) -> None:
        """Mark the start or end of validation/testing: a later failure names its stage."""
        # the end of validation inside training: training resumes; the end of a test: unknown
        self.stage_now = stage if event == "start" else ("train" if stage == "val" else None)
        self.emit(
            "STAGE",
            _compact(
                {
                    "t": _now(),
                    "rank": self.rank,
                    "stage": stage,
                    "event": event,
                    "epoch": epoch,
                    "iter": iter,
                }
            ),
        )

    def check_batch(
        self,
        batch: Any = None,
        *,
        labels: Sequence[Any] | None = None,
        images: Sequence[Any] | None = None,
        epoch: int | None = None,
        iter: int | None = None,
        step: int | None = None,
    ) -> int:
        """Report the samples of ``batch`` whose ground truth is empty; returns how many.

        ``batch``: mmengine's ``{'inputs', 'data_samples'}`` (``gt_instances.labels`` and
        ``metainfo['img_path'/'img_id']``), a list of data samples or of target dicts
        (torchvision ``labels``/``image_id``, HF DETR ``class_labels``), an ``(inputs, targets)``
        pair, or mmdet 2.x's ``gt_labels`` + ``img_metas``. Or pass ``labels`` (one label
        tensor/list per sample) and ``images`` (their paths or ids) directly.
        """
        samples: Sequence[Any] = labels if labels is not None else _samples(batch)
        if not samples:
            return 0
        empty = []
        for i, s in enumerate(samples):
            lab = s if labels is not None else _labels_of(s)
            if lab is not None and _size(lab) == 0:
                empty.append(i)
        if not empty:
            return 0
        self.empty_samples += len(empty)
        where = _compact({"rank": self.rank, "epoch": epoch, "iter": iter, "step": step})
        named: list[Any] = []
        for i in empty:
            image, image_id = _identity(samples[i] if labels is None else None, images, i)
            named.append(image if image is not None else image_id)
            self._data(
                where
                | _compact({"image": image, "image_id": image_id})
                | {"reason": EMPTY_GT, "index": i, "batch_size": len(samples)}
            )
        if len(empty) == len(samples) > 1:  # (a batch of one says so with batch_size 1)
            self._data(
                where
                | {"reason": EMPTY_BATCH, "batch_size": len(samples)}
                | {"images": [x for x in named if x is not None][:BATCH_IMAGES]}
            )
        return len(empty)

    def _data(self, payload: dict[str, Any]) -> None:
        if not self._bucket.take():
            self.suppressed += 1
            return
        payload["t"] = _now()
        if self.suppressed:
            payload["suppressed"] = self.suppressed  # findings not printed since the last line
            self.suppressed = 0
        self.emit("DATA", payload)

    def memory_summary(self, exc: BaseException | None = None) -> dict[str, Any]:
        """Print the device memory summary (torch_npu / torch.cuda), e.g. after an exception."""
        payload: dict[str, Any] = {"t": _now(), "rank": self.rank, "stage": self.stage_now}
        if exc is not None:
            text = f"{type(exc).__name__}: {exc}".strip()
            payload["exception"] = text[:500]
            payload["oom"] = type(exc).__name__ == "OutOfMemoryError" or (
                "out of memory" in str(exc).lower()
            )
        payload.update(memory_stats())
        self.emit("MEMORY", payload)
        return payload

    def install_excepthook(self) -> None:
        """On an uncaught exception: the usual traceback, then the memory summary."""
        if self._prev_hook is not None:
            return
        prev = sys.excepthook
        self._prev_hook = prev

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            prev(tp, value, tb)
            if not issubclass(tp, KeyboardInterrupt):
                try:
                    self.memory_summary(value)
                except Exception:  # never hide the original failure
                    pass

        sys.excepthook = hook

    def uninstall_excepthook(self) -> None:
        if self._prev_hook is not None:
            sys.excepthook = self._prev_hook
            self._prev_hook = None


# -- reading batches ---------------------------------------------------------------------------


def _samples(batch: Any) -> Sequence[Any]:
    if batch is None:
        return ()
    if isinstance(batch, Mapping):
        if "data_samples" in batch:
            return _seq(batch["data_samples"])
        if "gt_labels" in batch:  # mmdet 2.x: per-sample tensors beside their img_metas
            metas = _seq(batch.get("img_metas")) or ()
            labels = _seq(batch["gt_labels"])
            return [
                {"gt_labels": lab, **(metas[i] if i < len(metas) else {})}
                for i, lab in enumerate(labels)
            ]
        if "labels" in batch and _is_targets(batch["labels"]):  # HF DETR
            return _seq(batch["labels"])
        return ()
    if isinstance(batch, (list, tuple)):
        # torchvision detection loaders yield (images, targets)
        if len(batch) == 2 and _is_targets(batch[1]):
            return _seq(batch[1])
        return batch
    return _seq(getattr(batch, "data_samples", None))


def _seq(x: Any) -> Sequence[Any]:
    return x if isinstance(x, (list, tuple)) else ()


def _is_targets(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and _labels_of(x[0]) is not None


def _labels_of(sample: Any) -> Any:
    gi = getattr(sample, "gt_instances", None)
    if gi is not None:
        return getattr(gi, "labels", None)
    if isinstance(sample, Mapping):
        for k in _LABEL_KEYS:
            v = sample.get(k)
            if v is not None:
                return v
        return None
    return getattr(sample, "gt_labels", None)


def _size(x: Any) -> int | None:
    numel = getattr(x, "numel", None)
    if callable(numel):
        return int(numel())  # a tensor's element count: metadata, no device sync
    size = getattr(x, "size", None)
    if isinstance(size, int):
        return size  # numpy
    try:
        return len(x)
    except TypeError:
        return None


def _identity(sample: Any, images: Sequence[Any] | None, i: int) -> tuple[Any, Any]:
    image = image_id = None
    if sample is not None:
        meta = getattr(sample, "metainfo", None)
        if not isinstance(meta, Mapping):
            meta = sample if isinstance(sample, Mapping) else {}
        image = next((_scalar(meta[k]) for k in _IMAGE_KEYS if meta.get(k) is not None), None)
        image_id = next((_scalar(meta[k]) for k in _ID_KEYS if meta.get(k) is not None), None)
    if images is not None and i < len(images):
        given = _scalar(images[i])
        if isinstance(given, str):
            image = image or given
        else:
            image_id = image_id if image_id is not None else given
    return image, image_id


def _scalar(v: Any) -> Any:
    """A JSON-friendly id or path; tensors only when they are one element on the CPU."""
    if isinstance(v, (str, int)) and not isinstance(v, bool):
        return v
    if isinstance(v, float):
        return int(v) if v.is_integer() else v
    numel = getattr(v, "numel", None)
    if callable(numel):
        dev = getattr(getattr(v, "device", None), "type", "cpu")
        if dev == "cpu" and numel() == 1:
            return _scalar(v.item())
        return None
    item = getattr(v, "item", None)  # numpy scalars
    if callable(item) and getattr(v, "size", 1) == 1:
        return _scalar(item())
    return str(v)[:300] if v is not None else None


def _compact(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _now() -> float:
    t = time.time()
    return math.floor(t * 1000) / 1000


# -- module-level API (one probe per process) ----------------------------------------------------

_DEFAULT: Probe | None = None


def default() -> Probe:
    """The process's probe (stderr only); create your own ``Probe`` to pass a logger."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Probe()
    return _DEFAULT


def announce(
    *, work_dir: str | None = None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Print this rank's facts once: identity, versions, device, timeouts, determinism."""
    return default().announce(work_dir=work_dir, extra=extra)


def check_batch(batch: Any = None, **kw: Any) -> int:
    """Report samples with empty ground truth in ``batch`` (see :meth:`Probe.check_batch`)."""
    return default().check_batch(batch, **kw)


def stage(name: str, event: str, **kw: Any) -> None:
    """``stage("val", "start")`` / ``stage("val", "end")`` around validation."""
    default().stage(name, event, **kw)


def memory_summary(exc: BaseException | None = None) -> dict[str, Any]:
    """Print the device memory summary now."""
    return default().memory_summary(exc)


def install_excepthook() -> None:
    """Print the device memory summary after an uncaught exception's traceback."""
    default().install_excepthook()
