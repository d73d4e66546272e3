"""Following files: identity, offsets, rotation, truncation, complete lines only.

Identity is not the path (ARCHITECTURE.md, invariant 3): a record is one generation of one
inode. A file found smaller than its committed offset, or whose bytes just before the offset
changed, starts a new generation from 0. Rotated copies are judged in ``copies``;
the lines themselves are read in ``lines``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from ..stream import StreamState
from .copies import CopyJudge
from .discover import Root, rank_from_path, settle_roots, sniff_bytes, walk
from .lines import read_lines
from .records import TAIL, Chunk, SourceRecord, digest, link_target

log = logging.getLogger("nanwatch.sources")

MAX_LINE = 1 << 20  # a longer line is cut to this many bytes and counted
READ_CHUNK = 4 << 20
MAX_OPEN = 512


class Tracker:
    """Keeps the records of every followed file and reads what is new in them; its copy judge
    tells which new files are rotated copies of followed ones (``copies``)."""

    def __init__(
        self,
        roots: list[Root],
        assign_run: Callable[[Root, str], int],
        *,
        known: Iterable[SourceRecord] = (),
        next_gen: Callable[[int, int], int] | None = None,
        live: bool = True,
        max_line: int = MAX_LINE,
        read_chunk: int = READ_CHUNK,
    ) -> None:
        self.roots = roots
        self.assign_run = assign_run
        # generations are numbered by the store: a reused inode must never reuse a generation
        self.next_gen = next_gen or (lambda dev, ino: 0)
        self.live = live
        self.max_line = max_line
        self.read_chunk = read_chunk
        self.records: dict[tuple[int, int], SourceRecord] = {}
        self.retired: list[SourceRecord] = []  # recently truncated/rotated generations
        self.ignored: dict[tuple[int, int], float] = {}  # binary files (by identity)
        self.unreadable: dict[str, float] = {}
        self._open: OrderedDict[tuple[int, int], int] = OrderedDict()
        # records whose path no longer shows their file: renamed or gone? the next walk says
        self.suspects: set[tuple[int, int]] = set()
        self.counters: dict[str, int] = {
            "files_binary": 0,
            "lines_cut": 0,
            "rotations": 0,
            "truncations": 0,
            "unreadable": 0,
        }
        self.copies = CopyJudge(self)
        for rec in known:
            if rec.status == "active":
                rec.target = link_target(rec.path)
                self.records[rec.key] = rec
            else:
                self.retired.append(rec)

    # -- discovery -------------------------------------------------------------------------------

    def root_for(self, path: str) -> Root | None:
        for r in self.roots:
            if r.contains(path):
                return r
        return None

    def discover(self) -> list[SourceRecord]:
        """Walk every root; start records for new files; notice renames, truncations, deletions."""
        settle_roots(self.roots)
        seen: set[tuple[int, int]] = set()
        new: list[SourceRecord] = []
        for root in self.roots:
            for path in walk(root):
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue  # hard link or the same file under two roots
                seen.add(key)
                rec = self.records.get(key)
                if rec is not None and rec.path != path and not self._same_bytes(rec, path):
                    # renamed and emptied (copytruncate, then a rename), or the inode of a file
                    # deleted while we were away, reused: either way the bytes read are not
                    # here; the old generation stays a twin for copies of it, the file is
                    # judged afresh
                    log.info("%s: its inode now holds other bytes at %s", rec.path, path)
                    self._retire(rec, "truncated")
                    rec = None
                if rec is not None:
                    self.suspects.discard(key)
                    if rec.path != path:
                        log.info("%s: renamed to %s; following it", rec.path, path)
                        self.counters["rotations"] += 1
                        rec.path = path
                        rec.renamed = True
                        rec.target = link_target(path)
                    continue
                if key in self.ignored:
                    continue
                created = self._new_file(root, path, st)
                if created is not None:
                    new.append(created)
        # Records whose inode is no longer under any root: drain what is left, then retire.
        for key, rec in list(self.records.items()):
            if key in seen or rec.status == "pending":
                continue
            if rec.fd is not None:
                continue  # still readable through the open descriptor; retired once drained
            self._retire(rec, "gone")
        return new

    def _new_file(self, root: Root, path: str, st: os.stat_result) -> SourceRecord | None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except PermissionError:
            if path not in self.unreadable:
                log.warning("%s: permission denied; grant read access to follow it", path)
                self.counters["unreadable"] += 1
            self.unreadable[path] = time.monotonic()
            return None
        except OSError:
            return None
        try:
            head = os.pread(fd, 4096, 0)
            # the size now, not the walk's: a copy being written grows between the two
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            return None
        kind = sniff_bytes(head)
        key = (st.st_dev, st.st_ino)
        if kind == "binary":
            os.close(fd)
            self.ignored[key] = time.monotonic()
            self.counters["files_binary"] += 1
            return None
        self.unreadable.pop(path, None)
        rec = SourceRecord(
            path=path,
            root=root,
            dev=st.st_dev,
            ino=st.st_ino,
            size=size,
            gen=self._gen(st.st_dev, st.st_ino),
        )
        rec.state.rank = rank_from_path(path, root.base)
        rec.target = link_target(path)
        rec.fd = fd
        self._remember_fd(rec)
        self.copies.place(rec, fd, size, wait=self.live)
        if rec.copy_of is not None:
            rec.run_id = rec.copy_of.run_id
        elif size > 0:
            # an empty file (stdout opened before the job starts) is placed once it has bytes:
            # by then the launch folder it belongs to usually exists
            rec.run_id = self.assign_run(root, path)
        self.records[key] = rec
        return rec

    def touched(self, paths: Iterable[str]) -> set[str]:
        """The followed paths that the watcher's touched paths stand for.

        A symlink's target stands for the link. A file not followed yet is looked at now
        rather than at the next walk: made readable (chmod is an attribute change, not a
        creation), or its creation was missed."""
        wanted = set(paths)
        if not wanted:
            return wanted
        followed = {rec.path for rec in self.records.values()}
        links: dict[str, list[str]] = {}
        for rec in self.records.values():
            if rec.target is not None:
                links.setdefault(rec.target, []).append(rec.path)
        out = set(wanted)
        for path in wanted:
            if path in followed:
                continue
            if path in links:
                out.update(links[path])
            else:
                self._adopt(path)
        return out

    def _adopt(self, path: str) -> SourceRecord | None:
        root = self.root_for(path)
        if root is None:
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode) or key in self.records or key in self.ignored:
            return None
        return self._new_file(root, path, st)

    def link_dirs(self) -> set[str]:
        """Folders holding the targets of followed symlinks."""
        return {
            os.path.dirname(rec.target)
            for rec in self.records.values()
            if rec.target is not None and rec.status == "active"
        }

    def _same_bytes(self, rec: SourceRecord, path: str) -> bool:
        """Does ``path`` still hold the bytes ``rec`` read before its offset?"""
        if rec.offset <= 0 or rec.tail_hash is None:
            # nothing read yet: a rename cannot be told from a reused inode, and judging the
            # file afresh loses and doubles nothing (and lets a rotated copy be recognised)
            return False
        try:
            with open(path, "rb") as f:
                lo = max(0, rec.offset - TAIL)
                f.seek(lo)
                tail = f.read(rec.offset - lo)
        except OSError:
            return False
        return len(tail) == rec.offset - lo and digest(tail) == rec.tail_hash

    def _gen(self, dev: int, ino: int, at_least: int = 0) -> int:
        # records are keyed by identity: one lookup there, the (short) retired list walked
        used = [r.gen + 1 for r in self.retired if (r.dev, r.ino) == (dev, ino)]
        current = self.records.get((dev, ino))
        if current is not None:
            used.append(current.gen + 1)
        return max([at_least, self.next_gen(dev, ino), *used])

    # -- reading ---------------------------------------------------------------------------------

    def _remember_fd(self, rec: SourceRecord) -> None:
        assert rec.fd is not None
        self._open[rec.key] = rec.fd
        self._open.move_to_end(rec.key)
        while len(self._open) > MAX_OPEN:
            key, fd = self._open.popitem(last=False)
            old = self.records.get(key)
            if old is not None and old.fd == fd:
                old.fd = None
            try:
                os.close(fd)
            except OSError:
                pass

    def ensure_fd(self, rec: SourceRecord) -> int | None:
        if rec.fd is not None:
            self._open.move_to_end(rec.key)
            return rec.fd
        try:
            fd = os.open(rec.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != rec.key:
            os.close(fd)
            return None
        rec.fd = fd
        self._remember_fd(rec)
        return fd

    def fd_size(self, rec: SourceRecord) -> tuple[int, int] | None:
        """The record's descriptor and its file's size now, or None when it cannot be read."""
        fd = self.ensure_fd(rec)
        if fd is None:
            return None
        try:
            return fd, os.fstat(fd).st_size
        except OSError:
            return None

    def close_fd(self, rec: SourceRecord) -> None:
        if rec.fd is not None:
            self._open.pop(rec.key, None)
            try:
                os.close(rec.fd)
            except OSError:
                pass
            rec.fd = None

    def _retire(self, rec: SourceRecord, status: str) -> None:
        self.close_fd(rec)
        rec.status = status
        if self.records.get(rec.key) is rec:
            del self.records[rec.key]
        # kept a while: truncated/rotated generations are twins for rotated copies, and every
        # status change is stored by the pipeline
        rec.since = time.monotonic()
        self.retired.append(rec)
        self.retired = self.retired[-256:]

    def retire_vanished(self, rec: SourceRecord) -> str:
        """Retire a record whose path no longer shows its file, drained through its open
        descriptor: 'rotated' while the file still has a name somewhere, else 'gone'."""
        try:
            st = os.fstat(rec.fd) if rec.fd is not None else None
        except OSError:
            st = None
        status = "rotated" if st is not None and st.st_nlink > 0 else "gone"
        self._retire(rec, status)
        return status

    def check(self, rec: SourceRecord) -> str:
        """Verify a record before reading: 'ok', 'truncated', 'replaced' or 'gone'."""
        if rec.status not in ("active", "copied-pending", "pending"):
            return rec.status
        fd = self.ensure_fd(rec)
        if fd is None:
            return "gone"
        try:
            st = os.fstat(fd)
        except OSError:
            return "gone"
        rec.size = st.st_size
        if st.st_size < rec.offset:
            return "truncated"
        if rec.offset > 0 and rec.tail_hash is not None:
            lo = max(0, rec.offset - TAIL)
            try:
                tail = os.pread(fd, rec.offset - lo, lo)
            except OSError:
                return "gone"
            if digest(tail) != rec.tail_hash:
                return "replaced"
        return "ok"

    def restart_generation(
        self, rec: SourceRecord, why: str, *, status: str = "truncated"
    ) -> SourceRecord:
        """The file under this identity now holds new content: retire the old generation; the
        new one takes over the open descriptor, so it is read in the same pass."""
        self.counters["truncations"] += 1
        log.info("%s: %s; reading it again from the start", rec.path, why)
        fresh = SourceRecord(
            path=rec.path,
            root=rec.root,
            dev=rec.dev,
            ino=rec.ino,
            run_id=rec.run_id,
            gen=self._gen(rec.dev, rec.ino, rec.gen + 1),
        )
        fresh.state = StreamState(
            rank=rec.state.rank,
            local_rank=rec.state.local_rank,
            node=rec.state.node,
            device=rec.state.device,
        )
        fd = rec.fd
        rec.fd = None
        self._open.pop(rec.key, None)
        rec.status = status
        rec.since = time.monotonic()
        self.retired.append(rec)
        self.retired = self.retired[-256:]
        fresh.fd = fd
        if fd is not None:
            self._remember_fd(fresh)
        self.records[fresh.key] = fresh
        return fresh

    def read(self, rec: SourceRecord, *, final: bool = False) -> Iterator[Chunk]:
        """Yield chunks of complete new lines; ``final`` also gives an unterminated last line."""
        if rec.status == "pending":
            return
        if rec.unjudged and rec.offset == 0 and not self.copies.judge(rec):
            return
        verdict = self.check(rec)
        if verdict in ("truncated", "replaced"):
            # a generation whose tail a rotated copy already took over is not a twin again
            status = "copied" if rec.status == "copied-pending" else "truncated"
            rec = self.restart_generation(
                rec,
                "truncated" if verdict == "truncated" else "content before the offset changed",
                status=status,
            )
        elif verdict == "gone":
            self.suspects.add(rec.key)  # the caller walks the roots: renamed, or really gone
            return
        if rec.status == "copied-pending":
            rec.status = "active"  # not truncated after all: the copy was a plain copy
        fd = rec.fd
        if fd is None:
            return
        yield from read_lines(
            rec,
            fd,
            final=final,
            read_chunk=self.read_chunk,
            max_line=self.max_line,
            counters=self.counters,
        )

    def settle_pending(self) -> list[SourceRecord]:
        """Decide files that waited to learn whether they are rotated copies; return them."""
        return self.copies.settle_pending()

    @staticmethod
    def committed(chunk: Chunk) -> None:
        """The store has the chunk's events and offset: move the record forward."""
        if chunk.final:
            return
        rec = chunk.record
        rec.offset = chunk.end
        rec.tail_hash = chunk.tail_hash
        rec.head_hash = chunk.head_hash
        rec.head_len = chunk.head_len
        rec.cutting = chunk.cutting
        rec.lines_cut += 0

    def retire_suspects(self) -> None:
        """After a walk: suspects it did not find anywhere under the roots are gone."""
        for key in list(self.suspects):
            rec = self.records.get(key)
            if rec is not None:
                self._retire(rec, "gone")
        self.suspects.clear()

    def drain_vanished(self) -> list[SourceRecord]:
        """Records whose path no longer shows their inode but whose descriptor is still open."""
        out = []
        for rec in list(self.records.values()):
            if rec.fd is None or rec.status != "active":
                continue
            try:
                st = os.stat(rec.path)
                same = (st.st_dev, st.st_ino) == rec.key
            except OSError:
                same = False
            if not same:
                out.append(rec)
        return out

    def close(self) -> None:
        for rec in list(self.records.values()):
            self.close_fd(rec)
        for fd in self._open.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._open.clear()
