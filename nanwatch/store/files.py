"""Who may read the database: it holds log lines, so it is never more open than its folder.

- A per-user database (``~/.local/state/nanwatch``, ``--db`` in a private folder) is 0600, and
  the folders nanwatch creates for it are 0700, whatever the umask.
- The service's database (``StateDirectory=nanwatch``, mode 0750, group ``nanwatch``) is 0640:
  a folder that lets its group in, and nobody else, passes group read on to the files, so the
  operators in that group can run the read commands. A world-accessible folder (``/tmp``) passes
  nothing on.
- ``-wal`` and ``-shm`` get the database file's mode from SQLite itself; files an older version
  left more open than this rule are narrowed when nanwatch (their owner) opens them for writing.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
from pathlib import Path

from ..errors import StoreError

log = logging.getLogger("nanwatch.store")

SERVICE_GROUP = "nanwatch"
SIDE_FILES = ("-wal", "-shm", ".lock")


def _service_gid() -> int | None:
    try:
        return grp.getgrnam(SERVICE_GROUP).gr_gid
    except KeyError:
        return None


def folder_mode() -> int:
    """0750 for folders the service (running as group nanwatch) creates, else 0700."""
    gid = _service_gid()
    return 0o750 if gid is not None and os.getegid() == gid else 0o700


def file_mode(folder: Path) -> int:
    """0640 in a folder open to its group only, else 0600."""
    try:
        mode = stat.S_IMODE(os.stat(folder).st_mode)
    except OSError:
        return 0o600
    return 0o640 if mode & 0o050 == 0o050 and not mode & 0o007 else 0o600


def make_folder(folder: Path) -> None:
    """Create ``folder`` and its missing parents with :func:`folder_mode` (not the umask's)."""
    missing = []
    for p in [folder, *folder.parents]:
        if os.path.exists(p):  # False, not PermissionError, under a folder we may not search
            break
        missing.append(p)
    mode = folder_mode()
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            continue
        except OSError as e:
            raise StoreError(f"{p}: cannot create the database folder ({e.strerror})") from None
        os.chmod(p, mode)  # the umask may have taken bits away; never adds any beyond `mode`


def prepare(db: Path) -> int:
    """Before SQLite opens ``db`` for writing: create it with the rule's mode, or narrow the
    files an older version left too open. Returns the mode."""
    mode = file_mode(db.parent)
    if not db.exists():
        try:
            fd = os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            pass
        except OSError:
            return mode  # SQLite's own open reports it, through the usual message
        else:
            os.close(fd)
            _share_with_folder_group(db, mode)
    uid = os.geteuid()
    for p in [db, *(Path(f"{db}{s}") for s in SIDE_FILES)]:
        try:
            st = os.stat(p)
            if st.st_uid == uid and stat.S_IMODE(st.st_mode) & ~mode:
                os.chmod(p, stat.S_IMODE(st.st_mode) & mode)
                log.info("%s: narrowed to mode %04o (it holds log lines)", p, mode)
        except OSError:
            continue
    return mode


def _share_with_folder_group(db: Path, mode: int) -> None:
    # group read means the folder's group (nanwatch), not whatever our primary group is
    if not mode & 0o040:
        return
    try:
        gid = os.stat(db.parent).st_gid
        if os.stat(db).st_gid != gid:
            os.chown(db, -1, gid)
    except OSError:
        pass  # not a member of that group: the file keeps ours


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def denied(path: Path) -> StoreError:
    """The message for a reader that may not open ``path`` (or search a folder above it)."""
    blocked = next((p for p in reversed(path.parents) if not os.access(p, os.X_OK)), path)
    try:
        bst = os.stat(blocked)
    except OSError:
        return StoreError(f"{path}: permission denied; pass a --db you may read")
    group = _group_name(bst.st_gid)
    return StoreError(
        f"{path}: permission denied ({blocked} is mode {stat.S_IMODE(bst.st_mode):04o}, owner "
        f"{_owner_name(bst.st_uid)}, group {group}); to read the service's database, add "
        f"yourself to group {group} (sudo usermod -aG {group} $USER, then log in again)"
    )


def unreadable(path: Path) -> bool:
    """True when this user may not read ``path`` or search a folder above it."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except OSError:
        return False  # absent: the caller says there is no database yet
    return not os.access(path, os.R_OK)
