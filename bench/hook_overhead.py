"""NanwatchHook's cost per training iteration, on CPU, for a batch of 16 samples.

    python bench/hook_overhead.py [--iters 20000] [--batch 16] [--repeat 5]

A real mmengine Runner (tiny model, log file in a temporary work_dir) runs the hook's
``before_run`` (facts, excepthook); then ``before_train_iter`` is timed on batches built the way
mmdet's PackDetInputs builds them (a data sample per image: ``gt_instances`` with labels and
boxes, metainfo with ``img_path``/``img_id``/shapes):

- ``healthy``: every sample has ground truth (the steady state: nothing is printed);
- ``one_empty``: one sample of each batch has none (a line per finding until the rate limit
  holds them back, then counting only);
- ``baseline``: mmengine's own ``Hook.before_train_iter`` (a no-op), to show the call itself.

Prints one JSON object: microseconds per iteration (median over ``--repeat`` runs) per case.
Target: under 100 us (0.1 ms) per iteration for ``healthy``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from typing import Any


def make_batch(n: int, empty: int) -> dict[str, Any]:
    import torch
    from mmengine.structures import BaseDataElement, InstanceData

    samples = []
    for i in range(n):
        k = 0 if i < empty else 3 + i % 5
        s = BaseDataElement(
            metainfo={
                "img_id": 1000 + i,
                "img_path": f"data/coco/train2017/{1000 + i:012d}.jpg",
                "ori_shape": (480, 640),
                "img_shape": (800, 1066),
                "scale_factor": (1.666, 1.666),
            }
        )
        s.gt_instances = InstanceData(labels=torch.randint(0, 80, (k,)), bboxes=torch.rand(k, 4))
        samples.append(s)
    inputs = [torch.zeros(3, 32, 32, dtype=torch.uint8) for _ in range(n)]
    return {"inputs": inputs, "data_samples": samples}


def build_runner(work_dir: str) -> Any:
    import torch
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Tiny(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(1, 1)

        def forward(self, *a: Any, **k: Any) -> Any:  # pragma: no cover - never trained here
            return {}

    return Runner(model=Tiny(), work_dir=work_dir)


def time_calls(fn: Any, runner: Any, batch: Any, iters: int) -> float:
    """Microseconds per call."""
    t0 = time.perf_counter_ns()
    for i in range(iters):
        fn(runner, i, batch)
    return (time.perf_counter_ns() - t0) / iters / 1000.0


def run(iters: int = 20000, batch: int = 16, repeat: int = 5) -> dict[str, Any]:
    from mmengine.hooks import Hook

    from nanwatch.integrations.mmengine import NanwatchHook

    with tempfile.TemporaryDirectory(prefix="nanwatch-hook-") as work_dir:
        runner = build_runner(work_dir)
        # the log file stays, the console does not get a line per finding during the run
        for h in runner.logger.handlers:
            if type(h) is logging.StreamHandler:
                h.setLevel(logging.ERROR)
        hook = NanwatchHook()
        stderr, sys.stderr = sys.stderr, open("/dev/null", "w")  # noqa: SIM115
        try:
            hook.before_run(runner)
            cases = {
                "baseline": (Hook().before_train_iter, make_batch(batch, 0)),
                "healthy": (hook.before_train_iter, make_batch(batch, 0)),
                "one_empty": (hook.before_train_iter, make_batch(batch, 1)),
            }
            out: dict[str, Any] = {"batch": batch, "iters": iters}
            for name, (fn, data) in cases.items():
                time_calls(fn, runner, data, min(iters, 1000))  # warm-up
                runs = [time_calls(fn, runner, data, iters) for _ in range(repeat)]
                out[f"{name}_us"] = round(statistics.median(runs), 2)
            assert hook.probe is not None
            out["records_printed"] = hook.probe.lines
            out["empty_samples_seen"] = hook.probe.empty_samples
            hook.after_run(runner)
        finally:
            sys.stderr.close()
            sys.stderr = stderr
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    result = run(args.iters, args.batch, args.repeat)
    print(json.dumps(result))
    return 0 if result["healthy_us"] < 100.0 else 1


if __name__ == "__main__":
    sys.exit(main())
