"""The watcher's wake-ups: writes come from an inotify reader of its own that reads every write
made before a pass begins at once; watchdog reports comings and goings."""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nanwatch.sources.discover import make_roots
from nanwatch.sources.watcher import Watcher, _Writes


def _until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Watcher, threading.Event, list[int], Path]]:
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "rank0.log"
    log.write_text("first\n")
    (logs / "rank1.log").write_text("first\n")
    wake = threading.Event()
    watcher = Watcher(make_roots([str(logs)]), wake)
    reads: list[int] = []  # how many paths each read of the writes' reader handed over
    real = watcher._written

    def written(paths: set[str], overflowed: bool) -> None:
        reads.append(len(paths))
        real(paths, overflowed)

    watcher._written = written  # type: ignore[method-assign]
    assert watcher.start()
    watcher.follow(set(), files=[str(log)])
    watcher.take()
    wake.clear()
    try:
        yield watcher, wake, reads, log
    finally:
        watcher.stop()


def test_a_write_to_a_followed_file_wakes_the_pass_with_its_path(
    watched: tuple[Watcher, threading.Event, list[int], Path],
) -> None:
    watcher, wake, _, log = watched
    with log.open("a") as f:
        f.write("second\n")
    _until(wake.is_set, "the wake-up")
    dirty, structural = watcher.take()
    assert dirty == {str(log)} and not structural


def test_writes_made_before_the_pass_begins_are_read_at_once(
    watched: tuple[Watcher, threading.Event, list[int], Path],
) -> None:
    watcher, _, reads, log = watched
    with log.open("ab", buffering=0) as f:
        f.write(b"one\n")
        _until(lambda: bool(reads), "the first write")
        for i in range(500):  # a busy rank between two passes: one write(2) per line
            f.write(b"line %d\n" % i)
    # the reader waits for the pass: 500 writes are one read more when it begins
    assert len(reads) == 1
    dirty, _ = watcher.take()
    assert dirty == {str(log)} and len(reads) == 2


def test_a_pass_takes_the_writes_made_before_it_begins_that_the_reader_has_not_read(
    watched: tuple[Watcher, threading.Event, list[int], Path],
) -> None:
    watcher, _, reads, log = watched
    other = log.parent / "rank1.log"
    with log.open("a") as f:
        f.write("second\n")
    _until(lambda: bool(reads), "the first write")
    with other.open("a") as f:  # the reader waits for the pass: this one is still queued
        f.write("second\n")
    dirty, _ = watcher.take()
    assert dirty == {str(log), str(other)}


def test_a_file_created_is_a_structural_change(
    watched: tuple[Watcher, threading.Event, list[int], Path],
) -> None:
    watcher, _, _, log = watched
    (log.parent / "rank2.log").write_text("hello\n")
    _until(lambda: watcher.take()[1], "the creation")


def test_writes_wake_a_process_that_holds_more_than_1024_descriptors(tmp_path: Path) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip("needs a descriptor limit above 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(1100)]  # the reader's own descriptors come above them
    got: list[set[str]] = []
    try:
        w = _Writes(lambda paths, overflowed: got.append(paths))
        assert w.fd > 1024
        w.watch({str(tmp_path)})
        (tmp_path / "rank0.log").write_text("hello\n")
        _until(lambda: bool(got), "the write")
        assert got[0] == {str(tmp_path / "rank0.log")}
        w.stop()
    finally:
        for fd in [*held, null]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_reader_maps_names_to_paths_and_notes_lost_events(tmp_path: Path) -> None:
    got: list[tuple[set[str], bool]] = []
    w = _Writes(lambda paths, overflowed: got.append((paths, overflowed)))
    try:
        w.watch({str(tmp_path)})
        (wd,) = w._wds

        def event(wd: int, mask: int, name: bytes = b"") -> bytes:
            padded = name + b"\0" * (16 - len(name) % 16) if name else b""
            return struct.pack("iIII", wd, mask, 0, len(padded)) + padded

        paths, overflowed = w._parse(event(wd, 0x2, b"rank0.log") + event(wd, 0x2, b"a.log"))
        assert paths == {str(tmp_path / "rank0.log"), str(tmp_path / "a.log")}
        assert not overflowed
        assert w._parse(event(-1, 0x4000)) == (set(), True)  # the queue overflowed
        assert w._parse(event(wd, 0x4 | 0x40000000, b"sub")) == (set(), True)  # a folder's mode
        assert w._parse(event(wd, 0x8000)) == (set(), False)  # the folder's watch went
        assert w._wds == {} and w._dirs == {}
        assert w._parse(event(wd, 0x2, b"late.log")) == (set(), False)
    finally:
        w.stop()
    assert not any(t.name == "nanwatch-writes" and t.is_alive() for t in threading.enumerate())
    assert got == []  # nothing was written in the folder
    assert os.path.isdir(tmp_path)


def test_stop_ends_the_reader_when_it_comes_between_a_read_and_its_hand_over(
    tmp_path: Path,
) -> None:
    stopper: list[threading.Thread] = []

    class Racing(_Writes):
        def _parse(self, data: bytes) -> tuple[set[str], bool]:
            got = super()._parse(data)
            # stop() runs to its join while this read is not handed over yet
            stopper.append(threading.Thread(target=self.stop))
            stopper[0].start()
            self.taken.wait()
            return got

    touched: list[set[str]] = []
    w = Racing(lambda paths, overflowed: touched.append(paths))
    w.watch({str(tmp_path)})
    (tmp_path / "rank0.log").write_text("hello\n")
    _until(lambda: bool(stopper), "the read")
    stopper[0].join()
    assert not w._thread.is_alive()
    assert touched == []  # a reader that is stopping hands nothing over
