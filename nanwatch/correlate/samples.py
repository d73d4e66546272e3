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
from typing import Any

from ..store.db import Store
from ..store.metrics import Metrics

SAMPLE_REASONS = ("empty ground truth", "empty batch")
WINDOW = 50  # iterations looked back when the run logged no finite iteration before the NaN
LIMIT = 20


def related(
    store: Store, run_id: int | None, origin: Mapping[str, Any], *, limit: int = LIMIT
) -> list[dict[str, Any]]:
    """The sample findings of ``run_id`` in the steps that lead to ``origin`` (closest first)."""
    step = origin.get("step")
    if run_id is None or not isinstance(step, int):
        return []
    if origin.get("tag"):
        hi = step + 1
        lo = hi - 1
    else:
        hi = step
        last = Metrics(store).trained_before(run_id, hi)
        lo = last if last is not None else max(0, hi - WINDOW)
    rows = store.conn.execute(
        "SELECT min(id), rank, epoch, iter, step, json_extract(fields, '$.reason') AS reason, "
        "json_extract(fields, '$.image'), json_extract(fields, '$.image_id'), min(time) "
        "FROM events WHERE run_id = ? AND kind = 'data_issue' AND step BETWEEN ? AND ? "
        f"AND reason IN ({','.join('?' * len(SAMPLE_REASONS))}) "
        # the same record read from the log file and from the captured stdout is one sample
        "GROUP BY rank, step, reason, json_extract(fields, '$.image'), "
        "json_extract(fields, '$.image_id')",
        (run_id, lo, hi, *SAMPLE_REASONS),
    ).fetchall()
    rank = origin.get("rank")
    out = []
    for eid, r, epoch, it, st, reason, image, image_id, when in rows:
        item = {"event_id": eid, "rank": r, "epoch": epoch, "iter": it, "step": st}
        item.update(reason=reason, image=image, image_id=image_id, time=when)
        out.append({k: v for k, v in item.items() if v is not None})
    out.sort(key=lambda d: (d.get("rank") != rank, -d["step"], d.get("rank") or 0, d["event_id"]))
    return out[:limit]
