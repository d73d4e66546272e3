"""Sources: complete lines only, identity not path, rotation, truncation, binaries, restarts."""

from __future__ import annotations

import gzip
import os
import shutil
import sqlite3
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nanwatch.config import Config
from nanwatch.daemon.pipeline import Pipeline
from nanwatch.sources.discover import rank_from_path, sniff_bytes
from nanwatch.sources.records import SourceRecord, rotated_name_of
from nanwatch.store import Store


def nan_line(i: int, iters: int = 100000) -> str:
    return (
        f"2026/11/30 10:00:00 - mmengine - INFO - Epoch(train)  [1][{i}/{iters}]  "
        f"lr: 1.0000e-04  eta: 0:01:00  time: 0.5000  data_time: 0.0100  memory: 100  loss: nan\n"
    )


def rank_log(tmp_path: Path, text: str) -> Path:
    """``logs/rank0.log`` under ``tmp_path`` holding ``text``."""
    d = tmp_path / "logs"
    d.mkdir()
    log = d / "rank0.log"
    log.write_text(text)
    return log


def ok_line(i: int, iters: int = 100000) -> str:
    return nan_line(i, iters).replace("loss: nan", "loss: 0.5000")


def nan_iters(db: Path) -> list[tuple[str, int]]:
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT s.path, e.iter FROM events e JOIN sources s ON s.id = e.source_id "
            "WHERE e.kind = 'nan' ORDER BY e.id"
        ).fetchall()
    finally:
        conn.close()
    return [(os.path.basename(p), i) for p, i in rows]


class Live:
    """A live pipeline driven step by step (no threads)."""

    def __init__(self, db: Path, paths: list[str]) -> None:
        self.db = db
        self.paths = paths
        self.store = Store.open(db)
        self.pipe = Pipeline(Config(), self.store, paths, live=True)

    def step(self) -> None:
        self.pipe.step()

    def restart(self) -> None:
        self.close()
        self.store = Store.open(self.db)
        self.pipe = Pipeline(Config(), self.store, self.paths, live=True)

    def close(self) -> None:
        self.pipe.tracker.close()
        self.store.close()


def test_partial_line_waits_for_its_newline(tmp_path: Path, db: Path) -> None:
    log = tmp_path / "logs" / "rank0.log"
    log.parent.mkdir()
    line = nan_line(1)
    log.write_text(line[:40])
    live = Live(db, [str(log.parent)])
    try:
        live.step()
        assert nan_iters(db) == []
        with log.open("a") as f:
            f.write(line[40:])
        live.step()
        live.step()
        assert nan_iters(db) == [("rank0.log", 1)]
    finally:
        live.close()


def test_restart_resumes_at_committed_offset(tmp_path: Path, db: Path) -> None:
    log = rank_log(tmp_path, "".join(nan_line(i) for i in range(1, 6)))
    d = log.parent
    live = Live(db, [str(d)])
    live.step()
    live.restart()
    with log.open("a") as f:
        f.write("".join(nan_line(i) for i in range(6, 9)))
    live.step()
    live.restart()
    live.step()
    live.close()
    assert [i for _, i in nan_iters(db)] == list(range(1, 9))


def test_truncation_starts_a_new_generation(tmp_path: Path, db: Path) -> None:
    log = rank_log(tmp_path, "".join(nan_line(i) for i in range(1, 4)))
    d = log.parent
    live = Live(db, [str(d)])
    try:
        live.step()
        # truncated and rewritten with fewer, different bytes
        log.write_text(nan_line(7))
        live.step()
        assert [i for _, i in nan_iters(db)] == [1, 2, 3, 7]
    finally:
        live.close()


def test_truncated_while_stopped_and_regrown_past_old_offset(tmp_path: Path, db: Path) -> None:
    log = rank_log(tmp_path, "".join(nan_line(i) for i in range(1, 3)))
    d = log.parent
    live = Live(db, [str(d)])
    live.step()
    live.close()
    # while stopped: truncated, then a new run writes more than before
    with log.open("r+") as f:
        f.truncate(0)
    log.write_text("".join(nan_line(i) for i in range(50, 55)))
    live = Live(db, [str(d)])
    live.step()
    live.close()
    assert [i for _, i in nan_iters(db)] == [1, 2, 50, 51, 52, 53, 54]


def test_rename_and_create_rotation(tmp_path: Path, db: Path) -> None:
    log = rank_log(tmp_path, nan_line(1))
    d = log.parent
    live = Live(db, [str(d)])
    try:
        live.step()
        with log.open("a") as f:
            f.write(nan_line(2))  # written before rotation, not yet read
        os.rename(log, d / "rank0.log.1")
        log.write_text(nan_line(3))
        live.step()
        assert sorted(i for _, i in nan_iters(db)) == [1, 2, 3]
    finally:
        live.close()


def test_copytruncate_rotation_reads_only_the_copy_tail(tmp_path: Path, db: Path) -> None:
    log = rank_log(tmp_path, nan_line(1) + nan_line(2))
    d = log.parent
    live = Live(db, [str(d)])
    try:
        live.step()
        with log.open("a") as f:
            f.write(nan_line(3))  # not yet read when logrotate copies
        shutil.copyfile(log, d / "rank0.log.1")
        with log.open("r+") as f:
            f.truncate(0)
        with log.open("a") as f:
            f.write(nan_line(4))
        live.step()
        live.step()
        assert sorted(i for _, i in nan_iters(db)) == [1, 2, 3, 4]
    finally:
        live.close()


def rank0_log(tmp_path: Path, lines: int) -> tuple[Path, str]:
    """logs/rank0.log holding NaN lines 1..lines; returns its path and text."""
    d = tmp_path / "logs"
    d.mkdir()
    log = d / "rank0.log"
    text = "".join(nan_line(i) for i in range(1, lines + 1))
    log.write_text(text)
    return log, text


@contextmanager
def following_rank0(tmp_path: Path, db: Path, lines: int) -> Iterator[tuple[Live, Path, str]]:
    """A live pipeline that has read logs/rank0.log (NaN lines 1..lines) once."""
    log, text = rank0_log(tmp_path, lines)
    live = Live(db, [str(log.parent)])
    try:
        live.step()
        yield live, log, text
    finally:
        live.close()


def finish_copytruncate(log: Path, copy: Path, rest: str, then: str = "") -> None:
    """logrotate's end of a copytruncate: the copy's last bytes, the original emptied; then
    the job writes on."""
    with copy.open("a") as f:
        f.write(rest)
    with log.open("r+") as f:
        f.truncate(0)
    if then:
        with log.open("a") as f:
            f.write(then)


def iters_after_two_passes(live: Live, db: Path) -> list[int]:
    """Two passes (a waiting copy settles, then what is new is read); the NaN iterations."""
    live.step()
    live.step()
    return sorted(i for _, i in nan_iters(db))


def test_copytruncate_copy_seen_half_written_is_not_read_from_zero(
    tmp_path: Path, db: Path
) -> None:
    with following_rank0(tmp_path, db, 40) as (live, log, text):
        copy = log.parent / "rank0.log.1"
        copy.write_text(text[: len(text) // 3])  # logrotate is still copying when we look
        live.step()
        assert len(nan_iters(db)) == 40  # nothing of the partial copy is read from byte 0
        # 41 was not yet read from the log
        finish_copytruncate(log, copy, text[len(text) // 3 :] + nan_line(41), nan_line(42))
        assert iters_after_two_passes(live, db) == list(range(1, 43))


def test_copytruncate_copy_seen_empty_is_judged_when_its_bytes_come(
    tmp_path: Path, db: Path
) -> None:
    with following_rank0(tmp_path, db, 20) as (live, log, text):
        copy = log.parent / "rank0.log.1"
        copy.touch()  # logrotate created its copy and has not written yet
        live.step()
        with copy.open("a") as f:
            f.write(text[:100])  # then part of it
        live.step()
        assert len(nan_iters(db)) == 20
        finish_copytruncate(log, copy, text[100:], nan_line(21))
        assert iters_after_two_passes(live, db) == list(range(1, 22))


def test_copy_bytes_landing_just_after_an_empty_look_are_not_read_from_zero(
    tmp_path: Path, db: Path
) -> None:
    with following_rank0(tmp_path, db, 20) as (live, log, text):
        copy = log.parent / "rank0.log.1"
        copy.touch()  # logrotate created its copy
        live.step()
        tracker = live.pipe.tracker
        looked = tracker.fd_size

        def look_then_logrotate_copies(rec: SourceRecord) -> tuple[int, int] | None:
            got = looked(rec)  # the copy is still empty when the tracker looks...
            if rec.path == str(copy) and got is not None and got[1] == 0:
                finish_copytruncate(log, copy, text)  # ...and filled right after
            return got

        tracker.fd_size = look_then_logrotate_copies  # type: ignore[method-assign]
        assert iters_after_two_passes(live, db) == list(range(1, 21))


def test_a_copy_half_written_when_nanwatch_restarts_is_not_read_from_zero(
    tmp_path: Path, db: Path
) -> None:
    with following_rank0(tmp_path, db, 40) as (live, log, text):
        copy = log.parent / "rank0.log.1"
        copy.write_text(text[: len(text) // 2])  # logrotate copies while nanwatch restarts
        live.restart()
        live.step()
        assert len(nan_iters(db)) == 40
        finish_copytruncate(log, copy, text[len(text) // 2 :], nan_line(41))
        assert iters_after_two_passes(live, db) == list(range(1, 42))


def test_a_copy_whose_first_bytes_fit_two_generations_settles_on_the_right_one(
    tmp_path: Path, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with following_rank0(tmp_path, db, 30) as (live, log, old):
        d = log.parent
        os.rename(log, d / "rank0.log.1")  # an earlier rotation (create)
        text = "".join(nan_line(i) for i in range(31, 50))
        log.write_text(text)
        live.step()
        # copytruncate: .1 -> .2, then the copy, caught after bytes both files start with
        os.rename(d / "rank0.log.1", d / "rank0.log.2")
        live.step()
        copy = d / "rank0.log.1"
        copy.write_text(text[:20])
        assert old[:20] == text[:20]
        live.step()
        pending = [r for r in live.pipe.tracker.records.values() if r.path == str(copy)]
        assert [r.status for r in pending] == ["pending"]
        finish_copytruncate(log, copy, text[20:], nan_line(50))
        # no grace left: only recognising the copy's real twin keeps it from byte 0
        monkeypatch.setattr("nanwatch.sources.copies.COPY_GRACE", 0.0)
        assert iters_after_two_passes(live, db) == list(range(1, 51))


def test_a_copy_resumed_at_its_twins_offset_keeps_it_across_a_kill(
    tmp_path: Path, db: Path
) -> None:
    with following_rank0(tmp_path, db, 20) as (live, log, text):
        copy = log.parent / "rank0.log.1"
        copy.touch()  # found empty: judged when its bytes come
        live.step()
        finish_copytruncate(log, copy, text)
        live.step()  # the copy resumes at byte len(text): nothing of it is read
        live.restart()  # killed: no further pass, nothing else committed
        live.step()
        assert sorted(i for _, i in nan_iters(db)) == list(range(1, 21))


def test_a_new_small_rotated_file_that_is_no_copy_is_read_at_once(tmp_path: Path, db: Path) -> None:
    with following_rank0(tmp_path, db, 20) as (live, log, _):
        (log.parent / "rank0.log.1").write_text(nan_line(99))  # other bytes: not a copy in progress
        live.step()
        assert ("rank0.log.1", 99) in nan_iters(db)


def test_side_by_side_identical_files_are_both_read(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    text = "".join(nan_line(i) for i in range(1, 4))
    (d / "rank0.log").write_text(text)
    (d / "train.log").write_text(text)  # e.g. stdout and mmengine's own file
    live = Live(db, [str(d)])
    try:
        live.step()
        got = nan_iters(db)
        assert sorted(got) == sorted(
            [(n, i) for n in ("rank0.log", "train.log") for i in (1, 2, 3)]
        )
    finally:
        live.close()


def test_new_rank_file_with_same_banner_is_read_at_once(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    banner = "".join(ok_line(i) for i in range(1, 20))
    (d / "rank0.log").write_text(banner)
    live = Live(db, [str(d)])
    try:
        live.step()
        (d / "rank1.log").write_text(banner + nan_line(20))
        live.step()
        assert nan_iters(db) == [("rank1.log", 20)]
    finally:
        live.close()


def test_binaries_are_skipped_by_content(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "work_dir"
    d.mkdir()
    (d / "rank0.log").write_text(nan_line(1))
    with gzip.open(d / "rank0.log.2.gz", "wt") as f:
        f.write(nan_line(99))
    with zipfile.ZipFile(d / "epoch_1.pth", "w") as z:
        z.writestr("archive/data.pkl", "loss: nan " * 100)
    (d / "blob.bin").write_bytes(bytes(range(256)) * 64)
    sqlite3.connect(d / "other.db").execute("CREATE TABLE t(x)").connection.close()
    live = Live(db, [str(d)])
    try:
        live.step()
        assert nan_iters(db) == [("rank0.log", 1)]
        assert live.pipe.tracker.counters["files_binary"] == 4
    finally:
        live.close()


def test_long_line_is_cut_with_bounded_memory(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    log = d / "rank0.log"
    with log.open("w") as f:
        f.write(nan_line(1))
        f.write("x" * (6 << 20))  # 6 MiB without a newline
    live = Live(db, [str(d)])
    try:
        live.step()
        with log.open("a") as f:
            f.write("y" * 1000 + "\n" + nan_line(2))
        live.step()
        assert [i for _, i in nan_iters(db)] == [1, 2]
        assert live.pipe.tracker.counters["lines_cut"] == 1
    finally:
        live.close()


def test_new_files_and_folders_appear_later(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "work_dirs"
    d.mkdir()
    live = Live(db, [str(d)])
    try:
        live.step()
        (d / "20261130_101500").mkdir()
        (d / "20261130_101500" / "rank3.log").write_text(nan_line(5))
        live.step()
        assert nan_iters(db) == [("rank3.log", 5)]
    finally:
        live.close()


@pytest.mark.parametrize(
    "hole, sparse",
    [(1000, True), (4 << 20, True), ((4 << 20) + 1, True), (50_000_000, True), (9 << 20, False)],
)
def test_a_hole_of_nul_bytes_after_copytruncate_keeps_the_line_after_it(
    tmp_path: Path, db: Path, hole: int, sparse: bool
) -> None:
    import tracemalloc

    d = tmp_path / "logs"
    d.mkdir()
    log = d / "rank0.log"
    # no O_APPEND (`python train.py > rank0.log`): after copytruncate the writer goes on at
    # its own offset, and the bytes before it read back as NULs (a sparse hole)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o644)
    live = Live(db, [str(d)])
    try:
        os.write(fd, nan_line(1).encode())
        live.step()
        shutil.copyfile(log, d / "rank0.log.1")
        os.truncate(log, 0)
        if sparse:
            os.lseek(fd, hole, os.SEEK_SET)
        else:  # zeros really written (a preallocating writer): skipped a chunk at a time
            os.pwrite(fd, bytes(hole), 0)
            os.lseek(fd, hole, os.SEEK_SET)
        os.write(fd, (nan_line(2) + nan_line(3)).encode())
        tracemalloc.start()
        try:
            live.step()
            live.step()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert sorted(i for _, i in nan_iters(db)) == [1, 2, 3]
        assert peak < 24 << 20  # read piece by piece, never the whole hole at once
        with (log).open("a") as f:
            f.write(nan_line(4))
        live.step()
        assert sorted(i for _, i in nan_iters(db)) == [1, 2, 3, 4]
    finally:
        os.close(fd)
        live.close()


def test_undecodable_bytes_and_crlf(tmp_path: Path, db: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    data = (
        b"\xff\xfe garbage \x00 bytes\n"
        + "训练开始 ".encode("gbk")
        + b"\n"
        + nan_line(1).encode().replace(b"\n", b"\r\n")
        + b"\x1b[31m"
        + nan_line(2).encode()
    )
    (d / "rank0.log").write_bytes(data)
    live = Live(db, [str(d)])
    try:
        live.step()
        assert [i for _, i in nan_iters(db)] == [1, 2]
    finally:
        live.close()


def test_rank_from_path() -> None:
    assert rank_from_path("/x/rank6.log") == 6
    assert rank_from_path("/x/train_rank6.log") == 6
    assert rank_from_path("/x/device6_rank6/stdout.log") == 6
    assert rank_from_path("/x/Nov30_15-48-51-rank1-de3ab572/actv_0-0.csv") == 1
    assert rank_from_path("/x/frank7.log") is None
    assert rank_from_path("/x/train.log") is None


def test_sniff() -> None:
    assert sniff_bytes(b"") == "unknown"
    assert sniff_bytes(b"hello\n") == "text"
    assert sniff_bytes(b"\x1f\x8b\x08\x00") == "binary"
    assert sniff_bytes(b"PK\x03\x04rest") == "binary"
    assert sniff_bytes(b"a\x00b\x00c\x00d\x00") == "binary"
    assert sniff_bytes(b"line with one \x00 nul and a lot of text " * 4) == "text"


def test_rotated_names() -> None:
    assert rotated_name_of("/l/rank0.log.1", "/l/rank0.log")
    assert rotated_name_of("/l/rank0.log-20261130", "/l/rank0.log")
    assert rotated_name_of("/l/rank0.log.2.gz", "/l/rank0.log")
    assert not rotated_name_of("/l/rank1.log", "/l/rank0.log")
    assert not rotated_name_of("/l/rank0.log.bak", "/l/rank0.log")
    assert rotated_name_of("/l/rank0.log.2", "/l/rank0.log.1")  # the original moved on too
    assert not rotated_name_of("/l/rank1.log.2", "/l/rank0.log.1")


def test_a_rename_noticed_by_a_pass_without_a_walk_is_followed_not_retired(
    tmp_path: Path, db: Path
) -> None:
    log = rank_log(tmp_path, nan_line(1))
    d = log.parent
    live = Live(db, [str(d)])
    try:
        live.step()
        with log.open("a") as f:
            f.write(nan_line(2))
        os.rename(log, d / "rank0.log.1")  # logrotate `create`, between two passes
        log.write_text(nan_line(3))
        live.pipe.step(discover=False, only=[str(log)])  # an inotify pass: no walk planned
        live.step()
        live.step()
        assert sorted(i for _, i in nan_iters(db)) == [1, 2, 3]
    finally:
        live.close()


@contextmanager
def following(
    db: Path, paths: list[str], mode: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pipeline]:
    """The `watch` loop in a thread; the safety rescan is pushed out of reach, so what
    arrives came through the watcher (or the poll interval), never the periodic walk."""
    import threading

    from nanwatch.config import SourcesConfig
    from nanwatch.daemon import pipeline as pipeline_mod

    monkeypatch.setattr(pipeline_mod, "SAFETY_POLL", 3600.0)
    config = Config(sources=SourcesConfig(mode=mode, poll_interval=0.2))
    store = Store.open(db)
    pipe = Pipeline(config, store, paths, live=True)
    stop = threading.Event()
    ready = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            pipe.watch(stop, on_ready=ready.set)
        except BaseException as e:  # surfaced by the test, not lost in the thread
            failed.append(e)
            ready.set()

    t = threading.Thread(target=run, name="watch-loop")
    t.start()
    try:
        assert ready.wait(30) and not failed, failed
        assert pipe.mode == mode
        yield pipe
    finally:
        stop.set()
        pipe.request_stop()
        t.join(30)
        store.close()
    assert not failed, failed


def read_iters(db: Path) -> list[int]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        return [r[0] for r in conn.execute("SELECT iter FROM events WHERE kind='nan' ORDER BY id")]
    finally:
        conn.close()


@pytest.mark.parametrize("mode", ["inotify", "poll"])
@pytest.mark.parametrize("kind", ["dir", "file", "glob", "existing dir"])
def test_a_path_that_appears_after_start_is_followed_and_again_when_recreated(
    tmp_path: Path, db: Path, mode: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..conftest import wait_for

    job = tmp_path / "job"  # not even the parent exists when watching starts
    logs = job / "work_dirs" / "20261130_101500"
    if kind == "existing dir":
        (job / "work_dirs").mkdir(parents=True)
    spec = {
        "existing dir": str(job / "work_dirs"),
        "dir": str(job / "work_dirs"),
        "file": str(logs / "rank0.log"),
        "glob": str(job / "work_*" / "*" / "rank*.log"),
    }[kind]
    with following(db, [spec], mode, monkeypatch):
        logs.mkdir(parents=True, exist_ok=True)
        (logs / "rank0.log").write_text(nan_line(1))
        wait_for(lambda: read_iters(db) == [1], timeout=10, what="the first line")
        with (logs / "rank0.log").open("a") as f:
            f.write(nan_line(2))
        wait_for(lambda: read_iters(db) == [1, 2], timeout=10, what="an appended line")
        shutil.rmtree(job)
        logs.mkdir(parents=True)
        (logs / "rank0.log").write_text(nan_line(3))
        wait_for(lambda: read_iters(db) == [1, 2, 3], timeout=10, what="the re-created file")


def test_lines_appended_to_a_symlinks_target_elsewhere_arrive_without_a_rescan(
    tmp_path: Path, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ..conftest import wait_for

    logs, elsewhere = tmp_path / "logs", tmp_path / "scratch" / "job42"
    logs.mkdir()
    elsewhere.mkdir(parents=True)
    target = elsewhere / "stdout.txt"
    target.write_text(nan_line(1))
    (logs / "rank0.log").symlink_to(target)
    with following(db, [str(logs)], "inotify", monkeypatch):
        wait_for(lambda: read_iters(db) == [1], timeout=10, what="the first line")
        with target.open("a") as f:
            f.write(nan_line(2))
        wait_for(lambda: read_iters(db) == [1, 2], timeout=10, what="a line through the link")
        # the link pointed elsewhere: the new target is the one followed
        other = elsewhere / "stdout-2.txt"
        other.write_text(nan_line(3))
        tmp_link = logs / ".rank0.log.tmp"
        tmp_link.symlink_to(other)
        os.rename(tmp_link, logs / "rank0.log")
        wait_for(lambda: read_iters(db) == [1, 2, 3], timeout=10, what="the new target")
        with other.open("a") as f:
            f.write(nan_line(4))
        wait_for(lambda: read_iters(db) == [1, 2, 3, 4], timeout=10, what="the new target's line")
