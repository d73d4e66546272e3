"""Wake-ups: watchdog (inotify) tells the pipeline that something changed; polling is the fallback.

Nothing slow happens on the watcher thread (invariant 4): it records the touched paths and sets
an event. Network filesystems (NFS, CIFS, Lustre, GPFS, ...) never deliver inotify events for
writes made on other hosts, so ``mode = "auto"`` polls them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

from .discover import Root

log = logging.getLogger("nanwatch.sources")

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


def filesystem_type(path: str) -> str | None:
    """The type of the mount holding ``path`` (from /proc/self/mounts), or None."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    real = os.path.realpath(path)
    best, best_len = None, -1
    for parts in mounts:
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
            best, best_len = parts[2], len(mnt)
    return best


def choose_mode(mode: str, roots: Iterable[Root]) -> tuple[str, str]:
    """('inotify' | 'poll', reason)."""
    if mode in ("inotify", "poll"):
        return mode, f"[sources] mode = {mode!r}"
    for r in roots:
        base = r.base if os.path.exists(r.base) else os.path.dirname(r.base)
        fs = filesystem_type(base)
        if fs in NETWORK_FS:
            return "poll", f"{r.spec} is on a {fs} mount, where inotify misses remote writes"
    return "inotify", "local filesystems"


_IGNORED = {"opened", "closed_no_write"}


class Watcher:
    """Wakes ``wake`` on filesystem activity below the roots; collects the touched paths."""

    def __init__(self, roots: list[Root], wake: threading.Event) -> None:
        self.roots = roots
        self.wake = wake
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._structural = False
        self._observer: Any = None
        self.watched: set[str] = set()
        self._handles: dict[str, Any] = {}

    def start(self) -> bool:
        """Start inotify watches; False when the system refuses (limits): the caller polls."""
        try:
            from watchdog.events import FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover
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
        ok = True
        for r in self.roots:
            base = r.base
            if base in self.watched or not os.path.isdir(base):
                continue
            try:
                handle = self._observer.schedule(self._handler, base, recursive=r.kind != "file")
                self._handles[base] = handle
                self.watched.add(base)
            except OSError as e:
                log.warning("%s: cannot watch with inotify (%s); polling it", base, e)
                ok = False
        return ok

    def rescan_roots(self) -> None:
        """Roots that did not exist at start are watched once they appear."""
        if self._observer is not None:
            self._schedule_all()

    def sync_roots(self) -> bool:
        """After a reload: watch the roots' folders now listed, drop the ones no longer needed.

        Starts inotify if it was not running; False when a watch could not be added.
        """
        if self._observer is None:
            return self.start()
        wanted = {r.base for r in self.roots}
        for base in [b for b in self._handles if b not in wanted]:
            try:
                self._observer.unschedule(self._handles.pop(base))
            except (KeyError, OSError):
                pass
            self.watched.discard(base)
        return self._schedule_all()

    def _touch(self, event: Any) -> None:
        etype = getattr(event, "event_type", "")
        if etype in _IGNORED:
            return  # our own reads show up as opened/closed_no_write: never wake on them
        paths = [getattr(event, "src_path", None), getattr(event, "dest_path", None)]
        with self._lock:
            for p in paths:
                if p:
                    self._dirty.add(os.fsdecode(p))
            if etype in ("created", "moved", "deleted") or getattr(event, "is_directory", False):
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
