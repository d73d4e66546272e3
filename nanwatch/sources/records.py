"""One followed file as nanwatch knows it: its record (one generation of one inode), the
chunks of complete lines read from it, and the checksums and rotation names by which its
identity is judged (ARCHITECTURE.md, invariant 3)."""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import field

from .._dc import dataclass
from ..stream import StreamState
from .discover import Root

HEAD = 1024  # bytes hashed for the head checksum
TAIL = 256  # bytes before the committed offset checked before every read


# logrotate names: name.1, name.1.gz, name-20261130, name-2026113012, name.20261130
_ROTATED_SUFFIX = re.compile(
    r"^(?:[.-]\d{1,10}|[.-]\d{8}(?:[-_]?\d{2,6})?)(?:\.gz|\.bz2|\.xz|\.zst)?$"
)


_TRAILING_ROTATION = re.compile(
    r"(?:[.-]\d{1,10}|[.-]\d{8}(?:[-_]?\d{2,6})?)(?:\.gz|\.bz2|\.xz|\.zst)?$"
)


def rotation_base(name: str) -> str:
    """rank0.log.2.gz -> rank0.log; rank0.log-20261130 -> rank0.log; rank0.log -> rank0.log."""
    base = os.path.basename(name)
    stripped = _TRAILING_ROTATION.sub("", base)
    return stripped or base


def rotated_name_of(candidate: str, original: str) -> bool:
    """Is ``candidate`` a rotated sibling of ``original`` (rank0.log, rank0.log.1, .2, ...)?

    Compared by base name, because the original may itself have been rotated meanwhile."""
    a, b = os.path.basename(candidate), os.path.basename(original)
    if a == b:
        return False
    base = rotation_base(b)
    if not a.startswith(base) or not _ROTATED_SUFFIX.match(a[len(base) :]):
        return False
    return b == base or bool(_ROTATED_SUFFIX.match(b[len(base) :]))


def _head_matches(fd: int, other: SourceRecord) -> bool:
    """Does the file behind ``fd`` start with the bytes ``other`` hashed as its head?"""
    try:
        head = os.pread(fd, other.head_len, 0)
    except OSError:
        return False
    return digest(head) == other.head_hash


def holds(fd: int, size: int, other: SourceRecord) -> bool:
    """Does the file behind ``fd`` hold ``other``'s bytes before its committed offset?"""
    if size < other.offset or other.tail_hash is None:
        return False
    if other.head_hash is not None and not _head_matches(fd, other):
        return False
    lo = max(0, other.offset - TAIL)
    try:
        tail = os.pread(fd, other.offset - lo, lo)
    except OSError:
        return False
    return digest(tail) == other.tail_hash


def link_target(path: str) -> str | None:
    """The resolved path when ``path`` itself is a symlink, else None."""
    return os.path.realpath(path) if os.path.islink(path) else None


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass
class SourceRecord:
    """One generation of one file. ``id`` is its row in the store once committed."""

    path: str
    root: Root
    dev: int
    ino: int
    run_id: int | None = None
    id: int | None = None
    gen: int = 0
    offset: int = 0
    head_hash: str | None = None
    head_len: int = 0
    tail_hash: str | None = None
    size: int = 0
    status: str = "active"  # active | pending | rotated | truncated | gone | unreadable
    state: StreamState = field(default_factory=StreamState)
    cutting: bool = False  # inside an over-long line whose rest is being skipped
    renamed: bool = False  # its path changed since the store last saw it
    lines_cut: int = 0
    since: float = field(default_factory=time.monotonic)
    copy_of: SourceRecord | None = None
    unjudged: bool = False  # an empty file with a rotated name: a copy may still be written in
    resumed: bool = False  # took its twin's offset: to be stored even though nothing was read
    saved_status: str | None = None  # the status the store was last given for it (retired)
    # the file a symlink's name leads to: writes there are not seen through the link's folder
    target: str | None = None
    fd: int | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass
class Chunk:
    """Complete lines read from one record, with the offset to commit once they are processed."""

    record: SourceRecord
    data: bytes
    start: int  # offset of data[0]
    end: int  # offset to commit (after skipped bytes of a cut line)
    tail_hash: str | None
    head_hash: str | None
    head_len: int
    cutting: bool
    cut: int = 0  # lines cut in this chunk
    final: bool = False  # an unterminated last line given for processing only (scan)
