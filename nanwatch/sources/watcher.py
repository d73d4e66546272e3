"""Wake-ups: watchdog (inotify) tells the pipeline that something changed; polling is the fallback.

Nothing slow happens on the watcher thread (invariant 4): it records the touched paths and sets
an event. Network filesystems (NFS, CIFS, Lustre, GPFS, ...) never deliver inotify events for
writes made on other hosts, so ``mode = "auto"`` polls them.
"""

from __future__ import annotations

import logging
import os
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
        self._observer = Observer()
        self._observer.daemon = True
        ok = self._schedule_all()
        try:
            self._observer.start()
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
                    watch = self._observer.schedule(self._handler, target, recursive=recursive)
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

    def follow(self, dirs: set[str]) -> None:
        """Also watch these folders (non-recursively): a symlink's target is written where
        it lives, and no event for it comes from the folder holding the link."""
        if self._observer is None:
            return
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
                self._extra[d] = self._observer.schedule(self._handler, d, recursive=False)
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

    def take(self) -> tuple[set[str], bool]:
        with self._lock:
            dirty, structural = self._dirty, self._structural
            self._dirty, self._structural = set(), False
        return dirty, structural

    def stop(self) -> None:
        if self._observer is not None:
            try:
                self._observer.stop()
                self._observer.join(5)
            except RuntimeError:
                pass
            self._observer = None
