"""Rotated copies (logrotate ``copytruncate``): is a file that appears a copy of a followed one,
and where does reading it resume?

A file that appears while a known one was just truncated or renamed, and holds that file's
bytes before its committed offset, is its rotated copy: reading resumes there instead of from
0. Files that already lived side by side are never copies of each other, even with identical
bytes. A copy is often caught before logrotate has finished (empty, half-written, or complete
but its twin not yet truncated): it waits, within a grace, rather than being read from 0.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from ..stream import StreamState
from .records import SourceRecord, holds, rotated_name_of, rotation_base

log = logging.getLogger("nanwatch.sources")

COPY_GRACE = 10.0  # seconds a new file may wait for its twin's truncation
PREFIX_CHECK = 64 << 10  # bytes compared at each end of a copy caught while being written


class Files(Protocol):
    """What the judge needs of the tracker: the records it follows and their descriptors."""

    records: dict[tuple[int, int], SourceRecord]
    retired: list[SourceRecord]  # replaced, not only appended to: read it each time
    counters: dict[str, int]

    def ensure_fd(self, rec: SourceRecord) -> int | None: ...

    def fd_size(self, rec: SourceRecord) -> tuple[int, int] | None: ...

    def check(self, rec: SourceRecord) -> str: ...


class CopyJudge:
    """Recognises rotated copies of the files a tracker follows."""

    def __init__(self, files: Files) -> None:
        self.files = files

    def place(self, rec: SourceRecord, fd: int, size: int, *, wait: bool) -> None:
        """Is a new file (or one that just got its first bytes) a rotated copy of a followed
        one? A copy whose twin was truncated or renamed resumes at the twin's offset. With
        ``wait`` (live, a restart's first walk included) a possible copy waits, up to
        COPY_GRACE: one made just before its twin's truncation, one still being written
        (logrotate copies, then truncates); an empty file with a rotated name is judged when
        its first bytes come."""
        twin = self._copy_candidate(rec, fd, size)
        if twin is not None and self._twin_rotated(twin):
            self._continue_from(rec, twin)
            return
        if not wait:
            return
        if twin is None:
            if size == 0:
                rec.unjudged = rotation_base(rec.path) != os.path.basename(rec.path)
                return
            twin = self._copy_candidate(rec, fd, size, partial=True)
        if twin is not None:
            rec.status = "pending"
            rec.copy_of = twin
            rec.since = time.monotonic()

    def judge(self, rec: SourceRecord) -> bool:
        """First bytes in a file that was empty with a rotated name: is it a copy? True when it
        is to be read now."""
        got = self.files.fd_size(rec)
        if got is None or got[1] == 0:
            # nothing to read; judged when bytes come. Not read now: bytes a copy writes just
            # after this look would be read from byte 0
            return False
        rec.unjudged = False
        self.place(rec, *got, wait=True)
        if rec.copy_of is not None:
            rec.run_id = rec.copy_of.run_id
        return rec.status != "pending"

    def _copy_candidate(
        self, rec: SourceRecord, fd: int, size: int, *, partial: bool = False
    ) -> SourceRecord | None:
        """A known generation in the same folder whose bytes before its offset this file holds.

        With ``partial``, a file shorter than that offset which starts like the generation
        (as far as its bytes go) is a candidate too: a copy caught while it is written."""
        if rotation_base(rec.path) == os.path.basename(rec.path):
            return None  # only a name with a rotation suffix (.1, -20261130) can be a copy
        folder = os.path.dirname(rec.path)
        pool = [*self.files.records.values(), *self.files.retired]
        for other in pool:
            if other is rec or other.offset <= 0 or other.tail_hash is None:
                continue
            if os.path.dirname(other.path) != folder or (size < other.offset) != partial:
                continue
            if not rotated_name_of(rec.path, other.path):
                continue  # side-by-side files (rank0.log, rank6.log) share banners, not identity
            if partial:
                if other.status == "active" and self._prefix_of(fd, size, other):
                    return other
                continue
            if holds(fd, size, other):
                return other
        return None

    def _prefix_of(self, fd: int, size: int, other: SourceRecord) -> bool:
        """Are the ``size`` bytes behind ``fd`` (their first and last 64 KiB) the start of
        ``other``'s file as it is now?"""
        theirs = self.files.ensure_fd(other)
        if theirs is None or size <= 0:
            return False
        spans = [(0, min(size, PREFIX_CHECK))]
        if size > PREFIX_CHECK:
            spans.append((max(PREFIX_CHECK, size - PREFIX_CHECK), size))
        try:
            return all(
                os.pread(fd, hi - lo, lo) == os.pread(theirs, hi - lo, lo) for lo, hi in spans
            )
        except OSError:
            return False

    def _twin_rotated(self, twin: SourceRecord) -> bool:
        """Was ``twin`` just truncated or renamed away (so a copy of it is its rotation)?"""
        if twin.status in ("truncated", "rotated"):
            return True
        try:
            st = os.stat(twin.path)
        except OSError:
            return twin.fd is not None  # renamed out of sight while we still hold it
        if (st.st_dev, st.st_ino) != twin.key:
            return True
        # truncated, or truncated and regrown with other bytes (e.g. while nanwatch was stopped)
        return self.files.check(twin) in ("truncated", "replaced")

    def _continue_from(self, rec: SourceRecord, twin: SourceRecord) -> None:
        log.info("%s: rotated copy of %s; reading from byte %d", rec.path, twin.path, twin.offset)
        self.files.counters["rotations"] += 1
        rec.offset = twin.offset
        rec.tail_hash = twin.tail_hash
        rec.head_hash = twin.head_hash
        rec.head_len = twin.head_len
        rec.state = StreamState.from_json(twin.state.to_json())
        rec.cutting = twin.cutting
        rec.run_id = twin.run_id
        rec.status = "active"
        rec.copy_of = None
        rec.resumed = True
        if twin.status in ("truncated", "rotated"):
            twin.status = "copied"
        else:
            # the twin still shows the old bytes: it will be found truncated on its next check
            twin.status = "copied-pending"

    def settle_pending(self) -> list[SourceRecord]:
        """Decide files that waited to learn whether they are rotated copies; return them."""
        now = time.monotonic()
        settled = []
        for rec in list(self.files.records.values()):
            if rec.status != "pending" or rec.copy_of is None:
                continue
            twin = rec.copy_of
            # a copy still being written (or no copy after all) waits, within the grace
            got = self.files.fd_size(rec) if rec.offset == 0 else None
            complete = rec.offset > 0
            if got is not None:
                # complete now, it may hold another generation's bytes than the one whose
                # start it shared while it was short
                found = twin if holds(*got, twin) else self._copy_candidate(rec, *got)
                if found is not None:
                    twin = rec.copy_of = found
                    complete = True
            if complete:
                self.files.check(twin)
                if self._twin_rotated(twin):
                    self._continue_from(rec, twin)
                    settled.append(rec)
                    continue
            if now - rec.since > COPY_GRACE:
                rec.status = "active"
                rec.copy_of = None
                settled.append(rec)
        return settled
