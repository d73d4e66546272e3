"""Wake-ups: watchdog (inotify) tells the pipeline that something changed; polling is the fallback.

Nothing slow happens on the watcher thread (invariant 4): it records the touched paths and sets
an event. Network filesystems (NFS, CIFS, Lustre, GPFS, ...) never deliver inotify events for
writes made on other hosts, so ``mode = "auto"`` polls them.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import threading
import warnings
from collections.abc import Iterable
from typing import Any

from .discover import Root, settle_roots

log = logging.getLogger("nanwatch.sources")


class _StopRace(logging.Filter):
    """watchdog logs an ERROR when an inotify event arrives while a watch is being removed
    (a folder unscheduled, the observer stopping); nothing is lost by it, so it is not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_StopRace())
# a folder created while its parent's recursive watch is being set up gets its watch twice;
# watchdog warns and keeps one (the same callback): nothing to tell anyone
warnings.filterwarnings(
    "ignore", message="Callback with id", category=RuntimeWarning, module="watchdog"
)

NETWORK_FS = {
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "lustre",
    "gpfs",
    "fuse.sshfs",
    "beegfs",
    "fuse.glusterfs",
    "glusterfs",
    "ceph",
    "fuse.ceph",
    "9p",
    "afs",
    "panfs",
    "wekafs",
}


def filesystem_type(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the mount holding ``path`` (from /proc/self/mounts), or None."""
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            table = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, best_len = None, -1
    for parts in table:
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
            best, best_len = parts[2], len(mnt)
    return best


def choose_mode(
    mode: str, roots: Iterable[Root], mounts: str = "/proc/self/mounts"
) -> tuple[str, str]:
    """('inotify' | 'poll', reason)."""
    if mode in ("inotify", "poll"):
        return mode, f"[sources] mode = {mode!r}"
    for r in roots:
        base = r.base if os.path.exists(r.base) else os.path.dirname(r.base)
        fs = filesystem_type(base, mounts)
        if fs in NETWORK_FS:
            return "poll", f"{r.spec} is on a {fs} mount, where inotify misses remote writes"
    return "inotify", "local filesystems"


_IGNORED = {"opened", "closed_no_write"}
MAX_LINK_DIRS = 64


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def inotify_capacity(bases: Iterable[str]) -> str | None:
    """Can every folder below ``bases`` get an inotify watch? None if so, else why not.

    watchdog skips subfolders it cannot watch without saying so, so the budget is probed on a
    scratch inotify instance first (one watch per folder, released at once)."""
    import ctypes
    import ctypes.util
    import errno

    name = ctypes.util.find_library("c")
    if not name:  # pragma: no cover
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        return f"inotify unavailable ({os.strerror(err)}; see fs.inotify.max_user_instances)"
    try:
        count = 0
        for base in bases:
            if not os.path.isdir(base):
                continue
            for dirpath, dirnames, _ in os.walk(base):
                dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
                wd = libc.inotify_add_watch(fd, os.fsencode(dirpath), 0x00000002)  # IN_MODIFY
                if wd < 0:
                    err = ctypes.get_errno()
                    if err in (errno.ENOSPC, errno.EMFILE, errno.ENOMEM):
                        return (
                            f"{count + 1} folders need inotify watches but the limit is reached "
                            f"({os.strerror(err)}; raise fs.inotify.max_user_watches)"
                        )
                    continue  # a folder that vanished or cannot be read: not a budget problem
                count += 1
        return None
    finally:
        os.close(fd)


_IN_MODIFY, _IN_ATTRIB, _IN_Q_OVERFLOW, _IN_IGNORED = 0x2, 0x4, 0x4000, 0x8000
_IN_ONLYDIR, _IN_ISDIR = 0x01000000, 0x40000000
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class _Writes:
    """Writes (and chmods) in the folders holding followed files, read from an inotify
    instance of its own by one thread.

    A busy node writes every rank log hundreds of times a second; through watchdog each write
    is three thread hand-offs and several objects (a quarter of the daemon's CPU under load),
    so watchdog only hears of comings and goings. This thread reads every write queued since
    its last read at once, then waits for the pass that will look at them to begin
    (``taken``) before it reads again: it wakes about once per pass, whatever the write rate.
    """

    def __init__(self, touch: Any) -> None:
        import ctypes
        import ctypes.util

        self._touch = touch  # (paths, overflowed) -> None
        self._ctypes = ctypes
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fd = self._libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd = fd
        self._stop_r, self._stop_w = os.pipe()
        self._dirs: dict[str, int] = {}  # folder -> watch descriptor
        self._wds: dict[int, str] = {}
        self.taken = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="nanwatch-writes", daemon=True)
        self._thread.start()

    def watch(self, dirs: set[str]) -> bool:
        """Watch exactly these folders; True when one was added (writes made before its watch
        was in place came with no event: the caller reads them once more)."""
        added = False
        for d in [d for d in self._dirs if d not in dirs]:
            self._libc.inotify_rm_watch(self.fd, self._dirs.pop(d))
        for d in dirs:
            if d in self._dirs:
                continue
            wd = self._libc.inotify_add_watch(
                self.fd, os.fsencode(d), _IN_MODIFY | _IN_ATTRIB | _IN_ONLYDIR
            )
            if wd < 0:
                err = os.strerror(self._ctypes.get_errno())
                log.debug("%s: cannot watch writes (%s)", d, err)
                continue
            self._dirs[d] = wd
            self._wds[wd] = d
            added = True
        return added

    def _run(self) -> None:
        # poll, not select: a busy process may hold descriptors past select's 1024
        waiter = select.poll()
        waiter.register(self.fd, select.POLLIN)
        waiter.register(self._stop_r, select.POLLIN)
        while True:
            try:
                ready = {fd for fd, _ in waiter.poll()}
            except OSError:
                return
            if self._stop_r in ready:
                return
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                return
            paths, overflowed = self._parse(data)
            if paths or overflowed:
                self.taken.clear()
                if self._stopping:  # stop() set ``taken`` before the clear: it would not again
                    return
                self._touch(paths, overflowed)
                # what comes before the next pass begins is read with one read, not one each
                # (the kernel queues them meanwhile; past its limit it says so: overflowed)
                self.taken.wait()

    def drain(self) -> tuple[set[str], bool]:
        """What is queued now, read on the caller's thread: a pass that begins takes the
        writes made up to its start, not only those the reader thread had read."""
        paths: set[str] = set()
        overflowed = False
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError:  # nothing queued (EAGAIN), or the instance is closing
                return paths, overflowed
            got, lost = self._parse(data)
            paths |= got
            overflowed = overflowed or lost

    def _parse(self, data: bytes) -> tuple[set[str], bool]:
        paths: set[str] = set()
        overflowed = False
        pos = 0
        while pos + _EVENT.size <= len(data):
            wd, mask, _cookie, size = _EVENT.unpack_from(data, pos)
            name = data[pos + _EVENT.size : pos + _EVENT.size + size].rstrip(b"\0")
            pos += _EVENT.size + size
            if mask & (_IN_Q_OVERFLOW | _IN_ISDIR):
                # writes were lost, or a folder's mode changed (it may have become readable):
                # every file is looked at, as after any structural change
                overflowed = True
            elif mask & _IN_IGNORED:
                d = self._wds.pop(wd, None)  # the folder went (watchdog tells the pipeline)
                if d is not None and self._dirs.get(d) == wd:
                    del self._dirs[d]
            elif name and (d := self._wds.get(wd)) is not None:
                paths.add(os.path.join(d, os.fsdecode(name)))
        return paths, overflowed

    def stop(self) -> None:
        self._stopping = True
        os.write(self._stop_w, b"x")
        self.taken.set()
        self._thread.join(5)
        for fd in (self.fd, self._stop_r, self._stop_w):
            os.close(fd)


def _structure_events() -> list[Any]:
    """What watchdog is asked to report: comings and goings, and closes after writing
    (writes and chmods come through ``_Writes``)."""
    from watchdog import events as e

    return [
        e.FileCreatedEvent,
        e.DirCreatedEvent,
        e.FileMovedEvent,
        e.DirMovedEvent,
        e.FileDeletedEvent,
        e.DirDeletedEvent,
        e.FileClosedEvent,
    ]


class Watcher:
    """Wakes ``wake`` on filesystem activity below the roots; collects the touched paths."""

    def __init__(self, roots: list[Root], wake: threading.Event) -> None:
        self.roots = roots
        self.wake = wake
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._structural = False
        self._observer: Any = None
        self._watches: dict[str, tuple[Any, tuple[int, int] | None]] = {}
        # folders of symlinks' targets outside the roots (one inotify instance each)
        self._extra: dict[str, Any] = {}
        self._extra_dirs: frozenset[str] = frozenset()
        self._writes: _Writes | None = None
        self._write_dirs: set[str] = set()

    def start(self) -> bool:
        """Start inotify watches; False when the system refuses (limits): the caller polls."""
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover
            return False
        problem = inotify_capacity([r.base for r in self.roots if r.kind != "file"])
        if problem:
            log.warning("%s; polling instead", problem)
            return False

        outer = self

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                outer._touch(event)

        self._handler = _Handler()
        self._filter = _structure_events()
        self._observer = Observer()
        self._observer.daemon = True
        ok = self._schedule_all()
        try:
            self._observer.start()
            self._writes = _Writes(self._written)
        except OSError as e:
            log.warning("inotify unavailable (%s); polling instead", e)
            return False
        return ok

    def _schedule_all(self) -> bool:
        """Watch each root's folder; a missing one through its nearest existing parent (to see
        it appear); a folder replaced by another (moved away and recreated) is watched again."""
        settle_roots(self.roots)
        ok = True
        for r in self.roots:
            # `mkdir -p` may make the next folder down before the watch on its parent is in
            # place: look again after each new watch until the nearest folder stays the same
            for _ in range(64):
                target, recursive = self._target(r)
                ident = _identity(target)
                known = self._watches.get(target)
                if known is not None and known[1] == ident:
                    break
                if known is not None:
                    try:
                        self._observer.unschedule(known[0])
                    except (KeyError, OSError, ValueError):
                        pass
                try:
                    watch = self._observer.schedule(
                        self._handler, target, recursive=recursive, event_filter=self._filter
                    )
                except OSError as e:
                    log.warning("%s: cannot watch with inotify (%s); polling it", target, e)
                    ok = False
                    break
                self._watches[target] = (watch, ident)
                if r.late:
                    settle_roots(self.roots)
                    r = next((x for x in self.roots if x.spec == r.spec and x.path == r.path), r)
        self._drop_unwanted()
        return ok

    def _drop_unwanted(self) -> None:
        """Forget the parents watched while a root was missing: their other children's
        comings and goings would make every pass a full walk."""
        wanted = {self._target(r)[0] for r in self.roots}
        for target in [t for t in self._watches if t not in wanted]:
            try:
                self._observer.unschedule(self._watches.pop(target)[0])
            except (KeyError, OSError, ValueError):
                pass

    @property
    def watched(self) -> set[str]:
        return set(self._watches)

    def rescan_roots(self) -> None:
        """After structural changes: watch roots that appeared or were replaced."""
        if self._observer is not None:
            self._schedule_all()

    def sync_roots(self) -> bool:
        """After a reload: watch the roots' folders now listed, drop the ones no longer needed.

        Starts inotify if it was not running; False when a watch could not be added.
        """
        if self._observer is None:
            return self.start()
        return self._schedule_all()

    def follow(self, dirs: set[str], files: Iterable[str] | None = None) -> None:
        """Also watch these folders (non-recursively): a symlink's target is written where
        it lives, and no event for it comes from the folder holding the link. ``files``: the
        followed files, when they may have changed (their folders' writes are watched; when
        a folder is added, the next pass comes at once, for what was written before)."""
        if self._observer is None:
            return
        if files is not None:
            self._write_dirs = {os.path.dirname(f) for f in files}
        if self._writes is not None:
            roots = {self._target(r)[0] for r in self.roots}
            if self._writes.watch(self._write_dirs | set(dirs) | roots):
                self.wake.set()
        wanted = sorted(d for d in dirs if not self._covered(d))
        if len(wanted) > MAX_LINK_DIRS:
            if len(self._extra) < MAX_LINK_DIRS:
                log.info(
                    "symlinks lead into %d folders; watching %d, the rest is found by the "
                    "periodic rescan",
                    len(wanted),
                    MAX_LINK_DIRS,
                )
            wanted = wanted[:MAX_LINK_DIRS]
        for d in [d for d in self._extra if d not in wanted]:
            try:
                self._observer.unschedule(self._extra.pop(d))
            except (KeyError, OSError, ValueError):
                pass
        for d in wanted:
            if d in self._extra:
                continue
            try:
                self._extra[d] = self._observer.schedule(
                    self._handler, d, recursive=False, event_filter=self._filter
                )
            except OSError as e:
                log.debug("%s: cannot watch a link target's folder (%s)", d, e)
        self._extra_dirs = frozenset(self._extra)

    def _covered(self, d: str) -> bool:
        for target, (watch, _) in self._watches.items():
            if d == target:
                return True
            if getattr(watch, "is_recursive", False) and d.startswith(target.rstrip("/") + "/"):
                return True
        return False

    @staticmethod
    def _target(r: Root) -> tuple[str, bool]:
        """The folder to watch for a root (its nearest existing one) and whether recursively."""
        target, recursive = r.base, r.kind != "file"
        while not os.path.isdir(target) and os.path.dirname(target) != target:
            target, recursive = os.path.dirname(target), False
        return target, recursive

    def _touch(self, event: Any) -> None:
        etype = getattr(event, "event_type", "")
        if etype in _IGNORED:
            return  # our own reads show up as opened/closed_no_write: never wake on them
        ends = (getattr(event, "src_path", None), getattr(event, "dest_path", None))
        paths = [os.fsdecode(p) for p in ends if p]
        # in a link target's folder only the targets matter; the roots' tree did not change
        extra = bool(paths) and all(os.path.dirname(p) in self._extra_dirs for p in paths)
        with self._lock:
            self._dirty.update(paths)
            if not extra and (
                etype in ("created", "moved", "deleted") or getattr(event, "is_directory", False)
            ):
                self._structural = True
        self.wake.set()

    def _written(self, paths: set[str], overflowed: bool) -> None:
        with self._lock:
            self._dirty.update(paths)
            self._structural = self._structural or overflowed
        self.wake.set()

    def take(self) -> tuple[set[str], bool]:
        writes = self._writes
        if writes is not None:
            queued, lost = writes.drain()
            if queued or lost:
                self._written(queued, lost)
        with self._lock:
            dirty, structural = self._dirty, self._structural
            self._dirty, self._structural = set(), False
        if writes is not None:
            writes.taken.set()  # the pass begins: writes from now on are read again
        return dirty, structural

    def stop(self) -> None:
        if self._writes is not None:
            self._writes.stop()
            self._writes = None
        if self._observer is not None:
            try:
                self._observer.stop()
                self._observer.join(5)
            except RuntimeError:
                pass
            self._observer = None
