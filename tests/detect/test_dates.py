"""Years of year-less timestamps come from the data (mtime, previous line), never from today."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path

from nanwatch.detect import Detector, load_rules
from nanwatch.events import format_utc
from nanwatch.sources.dates import infer_year, local_epoch
from nanwatch.stream import StreamState

JAN_2_2027 = local_epoch(2027, 1, 2, 12, 0, 0) or 0.0
DEC_1_2026 = local_epoch(2026, 12, 1, 12, 0, 0) or 0.0


def test_the_latest_year_not_after_the_bound() -> None:
    assert infer_year(11, 30, 10, 0, 0, bound=DEC_1_2026) == 2026
    assert infer_year(12, 31, 23, 59, 0, bound=JAN_2_2027) == 2026
    assert infer_year(1, 1, 0, 0, 5, bound=JAN_2_2027) == 2027
    # a line a little after its file's mtime (another host's clock) is still this year's
    assert infer_year(12, 2, 9, 0, 0, bound=DEC_1_2026) == 2026
    # 29 February exists only in leap years: the latest one before the bound
    assert infer_year(2, 29, 0, 0, 0, bound=DEC_1_2026) == 2024
    assert infer_year(4, 31, bound=DEC_1_2026) is None


def test_a_stream_rolls_over_forward_from_its_previous_line() -> None:
    prev = local_epoch(2026, 12, 31, 23, 59, 0)
    # the bound alone (a copy written years later) would pick 2030; the previous line says 2027
    later = local_epoch(2030, 6, 1, 0, 0, 0) or 0.0
    assert infer_year(1, 1, 0, 0, 5, bound=later, previous=prev) == 2027
    # clocks step back a little and ranks interleave: the same year, not the next
    assert infer_year(12, 31, 23, 58, 0, bound=later, previous=prev) == 2026


def _feed(detector: Detector, path: Path, text: str, state: StreamState) -> list[str | None]:
    events, _ = detector.feed(text.encode(), 0, state, str(path))
    return [e.time for e in events]


def test_glog_lines_across_new_year_are_one_timeline(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    text = (
        "E1231 23:59:58.100000 1234 ProcessGroupNCCL.cpp:1234] [Rank 0] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000) "
        "ran for 600010 milliseconds before timing out.\n"
        "E0101 00:00:03.200000 1234 ProcessGroupNCCL.cpp:1234] [Rank 1] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000) "
        "ran for 600020 milliseconds before timing out.\n"
    )
    log.write_text(text)
    os.utime(log, (JAN_2_2027, JAN_2_2027))
    # the daemon started in 2026 and is still running: its clock does not decide the year
    detector = Detector(load_rules(), clock=lambda: DEC_1_2026)
    times = _feed(detector, log, text, StreamState())
    assert times == [
        format_utc((local_epoch(2026, 12, 31, 23, 59, 58) or 0) + 0.1),
        format_utc((local_epoch(2027, 1, 1, 0, 0, 3) or 0) + 0.2),
    ]


def test_a_daemon_running_into_the_new_year_stamps_the_new_year(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    line = (
        "E0105 08:00:00.000000 99 ProcessGroupNCCL.cpp:1234] [Rank 3] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, Timeout(ms)=1800000) ran for "
        "1800001 milliseconds before timing out.\n"
    )
    log.write_text(line)
    jan_5 = local_epoch(2027, 1, 5, 8, 0, 1) or 0.0
    os.utime(log, (jan_5, jan_5))
    detector = Detector(load_rules(), clock=lambda: DEC_1_2026)  # started in December 2026
    assert _feed(detector, log, line, StreamState()) == [
        format_utc(local_epoch(2027, 1, 5, 8, 0, 0) or 0)
    ]
    # without a file, the injected clock is the bound
    assert _feed(detector, tmp_path / "absent.log", line, StreamState()) == [
        format_utc(local_epoch(2026, 1, 5, 8, 0, 0) or 0)
    ]
    assert _dt.datetime.fromtimestamp(DEC_1_2026).year == 2026
