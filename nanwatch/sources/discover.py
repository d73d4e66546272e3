"""Which files a PATH means: files, folders (recursive), globs; binaries skipped by content."""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from .._dc import dataclass
from ..errors import SourceError

SNIFF_BYTES = 4096

# Magic numbers of files that are never logs: archives, checkpoints, databases, images.
_MAGIC = (
    b"\x1f\x8b",  # gzip (logrotate compress)
    b"BZh",  # bzip2
    b"\xfd7zXZ\x00",  # xz
    b"\x28\xb5\x2f\xfd",  # zstd
    b"PK\x03\x04",  # zip: torch checkpoints, wheels
    b"\x80\x02",  # pickle protocols 2..5 (old torch.save)
    b"\x80\x03",
    b"\x80\x04",
    b"\x80\x05",
    b"SQLite format 3\x00",
    b"\x7fELF",
    b"\x89PNG",
    b"\x89HDF",
    b"\x93NUMPY",
    b"\xff\xd8\xff",  # jpeg
    b"GIF8",
    b"%PDF",
)
_TEXT_CONTROL = {9, 10, 12, 13, 27, 8, 0}
# deleting every byte a text file may hold leaves only the suspicious control bytes
_NOT_CONTROL = bytes(b for b in range(256) if b >= 32 or b in _TEXT_CONTROL)


def sniff_bytes(head: bytes) -> str:
    """'text', 'binary' or 'unknown' (too few bytes to tell) for a file's first bytes."""
    if not head:
        return "unknown"
    if head.startswith(_MAGIC):
        return "binary"
    if len(head) >= 16 and head[8:10] == b'{"' and int.from_bytes(head[:8], "little") < 1 << 30:
        return "binary"  # safetensors: u64 header length then JSON
    nul = head.count(0)
    if nul * 10 > len(head):
        return "binary"
    ctrl = len(head.translate(None, _NOT_CONTROL))
    if ctrl * 20 > len(head):
        return "binary"
    return "text"


def is_text_file(path: str | os.PathLike[str]) -> str:
    try:
        with open(path, "rb") as f:
            return sniff_bytes(f.read(SNIFF_BYTES))
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class Root:
    """One PATH as given to scan/watch or listed in ``[sources] paths``."""

    spec: str
    path: str  # absolute; a glob pattern for kind == "glob"
    kind: str  # file | dir | glob
    # named before it existed: it becomes a file or a folder root, whichever appears there
    late: bool = False

    def contains(self, path: str) -> bool:
        if self.kind == "file":
            return path == self.path
        if self.kind == "dir":
            return path == self.path or path.startswith(self.path.rstrip("/") + "/")
        return fnmatch.fnmatch(path, self.path)

    @property
    def base(self) -> str:
        """The directory that holds everything this root can match."""
        if self.kind == "dir":
            return self.path
        if self.kind == "file":
            return os.path.dirname(self.path)
        parts = []
        for part in Path(self.path).parts:
            if glob.has_magic(part):
                break
            parts.append(part)
        return str(Path(*parts)) if parts else "/"


def make_roots(specs: list[str], *, must_exist: bool = True) -> list[Root]:
    roots: list[Root] = []
    for spec in specs:
        expanded = os.path.expanduser(spec)
        absolute = os.path.abspath(expanded)
        if glob.has_magic(expanded):
            roots.append(Root(spec, absolute, "glob"))
        elif os.path.isdir(absolute):
            roots.append(Root(spec, absolute.rstrip("/") or "/", "dir"))
        elif os.path.isfile(absolute):
            roots.append(Root(spec, absolute, "file"))
        elif not must_exist:
            late = not os.path.exists(absolute)
            roots.append(Root(spec, absolute.rstrip("/") or "/", "file", late=late))
        elif os.path.exists(absolute):
            raise SourceError(f"{spec}: not a regular file or directory; pass log files or folders")
        else:
            raise SourceError(f"{spec}: no such file or directory; check the path")
    return roots


def settle_roots(roots: list[Root]) -> bool:
    """Give late roots the kind of what appeared at their path; True if one changed.

    In place: the tracker and the watcher hold this very list. A job's work_dir named in the
    config before the job made it is a folder root from the moment it exists."""
    changed = False
    for i, r in enumerate(roots):
        if not r.late:
            continue
        kind = "dir" if os.path.isdir(r.path) else "file" if os.path.exists(r.path) else r.kind
        if kind != r.kind:
            roots[i] = dataclasses.replace(r, kind=kind)
            changed = True
    return changed


def walk(root: Root) -> Iterator[str]:
    """Regular files below a root (recursively; symlinked files followed, symlinked dirs not)."""
    if root.kind == "file":
        if os.path.isfile(root.path):
            yield root.path
        return
    if root.kind == "glob":
        for p in sorted(glob.glob(root.path, recursive=True)):
            if os.path.isdir(p):
                yield from walk(Root(p, p, "dir"))
            elif os.path.isfile(p):
                yield p
        return
    stack = [root.path]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    subdirs.append(e.path)
                elif e.is_file(follow_symlinks=True):
                    st = e.stat(follow_symlinks=True)
                    if stat.S_ISREG(st.st_mode):
                        yield e.path
            except OSError:
                continue
        stack.extend(reversed(subdirs))


_RANK_RE = re.compile(r"(?:^|[^a-z0-9])rank[_-]?(\d{1,5})(?![0-9])", re.I)
# Ascend log folders name the device ("device-6/", "device_6"): on one node it stands for the rank
_DEVICE_RE = re.compile(r"(?:^|[^a-z0-9])(?:device|npu|gpu)[_-]?(\d{1,2})(?![0-9])", re.I)


def rank_from_path(path: str, root_base: str | None = None) -> int | None:
    """A global rank named by the file or its folders: rank6, _rank6.log, device6_rank6, rank_6/."""
    rel = os.path.relpath(path, root_base) if root_base else path
    parts = Path(rel).parts
    for part in reversed(parts):
        found = _RANK_RE.findall(part)
        if found:
            return int(found[-1])
    for part in reversed(parts):
        found = _DEVICE_RE.findall(part)
        if found:
            return int(found[-1])
    return None
