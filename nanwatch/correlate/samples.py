"""Training samples with empty ground truth just before a NaN (``detail.related_data_issues``).

An empty ``gt_labels`` gives an embedding an empty input (NaN in its backward on CANN before
8.0.0) and breaks other losses that divide by, match against or index the ground truth. Every
NaN incident therefore lists the samples the in-process companion reported in the iterations
that can have produced its first non-finite value:

- a tensor finding (msprobe) names the step where the NaN was born; msprobe counts optimizer
  steps from 0 and the framework its iterations from 1, so that is framework step S + 1, and
  the iteration before it is included (its update may have left a NaN in the weights);
- a loss line is printed every few iterations: the NaN was born after the last iteration the
  run logged as finite, so every step from that one up to the NaN's counts.

Samples on the origin's rank come first: a tensor finding names the rank whose input was
empty; a loss line is printed by one rank whatever rank's sample broke the all-reduced
gradients, so the others are listed too.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..store.events import Events, MetricReads
from ..store.records import JSON

SAMPLE_REASONS = ("empty ground truth", "empty batch")
WINDOW = 50  # iterations looked back when the run logged no finite iteration before the NaN
LIMIT = 20


def related(
    events: Events,
    metrics: MetricReads,
    run_id: int | None,
    origin: Mapping[str, JSON],
    *,
    limit: int = LIMIT,
) -> list[dict[str, JSON]]:
    """The sample findings of ``run_id`` in the steps that lead to ``origin`` (closest first)."""
    step = origin.get("step")
    if run_id is None or not isinstance(step, int):
        return []
    if origin.get("tag"):
        hi = step + 1
        lo = hi - 1
    else:
        hi = step
        last = metrics.last_finite_step_before(run_id, hi)
        lo = last if last is not None else max(0, hi - WINDOW)
    rank = origin.get("rank")
    out = []
    for s in events.sample_issues(run_id, lo, hi, SAMPLE_REASONS):
        item: dict[str, JSON] = {
            "event_id": s.event_id,
            "rank": s.rank,
            "epoch": s.epoch,
            "iter": s.iter,
        }
        item.update(step=s.step, reason=s.reason, image=s.image, image_id=s.image_id, time=s.time)
        out.append({k: v for k, v in item.items() if v is not None})
    out.sort(key=lambda d: (d.get("rank") != rank, -d["step"], d.get("rank") or 0, d["event_id"]))
    return out[:limit]
