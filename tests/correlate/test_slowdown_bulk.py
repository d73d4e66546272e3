"""The slowdown tracker's bulk path is its row-by-row reference, block after block."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from nanwatch.correlate.slowdown import RankStats, feed, feed_rows
from nanwatch.events import Metric
from nanwatch.store.metrics import Block, MetricColumns

# a row: (rank, step delta (0 repeats a step: a duplicate line), stage, step time)
ROW = st.tuples(
    st.sampled_from([0, 0, 0, 0, 1, None]),
    st.sampled_from([1, 1, 1, 2, 0, -1]),
    st.sampled_from(["train"] * 8 + ["val", None]),
    st.one_of(
        st.none(),
        st.just(0.0),
        st.floats(min_value=0.1, max_value=0.3),  # normal steps
        st.floats(min_value=0.6, max_value=2.0),  # slow steps
        st.floats(min_value=0.6, max_value=2.0),
    ),
)


def _blocks(rows: list[tuple], cuts: list[int]) -> list[Block]:
    metrics, step = [], 0
    for n, (rank, delta, stage, sec) in enumerate(rows):
        step += delta
        metrics.append(
            Metric(100 * n, rank, step if n % 17 else None, 1, step, stage, None, None, None, sec)
        )
    bounds = sorted({0, len(metrics), *(c % (len(metrics) + 1) for c in cuts)})
    return [
        Block(i, 1, 7 + i, MetricColumns.from_rows(metrics[a:b]))
        for i, (a, b) in enumerate(pairwise(bounds))
        if b > a
    ]


def _state(stats: dict[int, RankStats]) -> dict[int, object]:
    return {k: v.to_json() for k, v in sorted(stats.items())}


@settings(max_examples=100, deadline=None)
@given(st.lists(ROW, min_size=60, max_size=240), st.lists(st.integers(0, 200), max_size=6))
def test_bulk_and_row_by_row_keep_the_same_statistics(rows: list[tuple], cuts: list[int]) -> None:
    _both_ways(rows, cuts)


def _both_ways(rows: list[tuple], cuts: list[int]) -> None:
    """Feed the blocks both ways; the statistics agree after every block."""
    bulk: dict[int, RankStats] = {}
    reference: dict[int, RankStats] = {}
    for block in _blocks(rows, cuts):
        feed(bulk, block)
        feed_rows(reference, block)
        # the statistics are saved between passes: both read back what the other wrote
        assert _state(bulk) == _state(reference)
        bulk = {k: RankStats.from_json(v.to_json()) for k, v in bulk.items()}


def test_a_slowdown_is_found_at_the_same_step_either_way() -> None:
    rows = [(0, 1, "train", 0.2)] * 30 + [(0, 1, "train", 0.9)] * 12 + [(0, 1, "train", 0.2)] * 5
    for cuts in ([], [13], [5, 31, 36]):
        bulk: dict[int, RankStats] = {}
        reference: dict[int, RankStats] = {}
        for block in _blocks(rows, cuts):
            feed(bulk, block)
            feed_rows(reference, block)
        assert bulk[0].found is not None and bulk[0].found == reference[0].found
        assert bulk[0].found.at.step == 31 and bulk[0].last == reference[0].last == 47


@settings(max_examples=60, deadline=None)
@given(
    st.lists(ROW, min_size=60, max_size=240),
    st.lists(st.integers(0, 200), max_size=4),
    st.sampled_from([0, None]),
)
def test_blocks_of_one_rank_and_stage_keep_the_same_statistics(
    rows: list[tuple], cuts: list[int], rank: int | None
) -> None:
    # the usual block of a scan: every row of one rank, most or all of them training rows
    rows = [
        (rank, delta, "train" if i % 50 else stage, sec)
        for i, (_, delta, stage, sec) in enumerate(rows)
    ]
    _both_ways(rows, cuts)
