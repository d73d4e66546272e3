"""`nanwatch doctor`, this node's side: source paths, inotify limits, filesystem types."""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path
from typing import Any

from .._dc import dataclass
from .doctor import Finding, as_root_note, current_user

INOTIFY = Path("/proc/sys/fs/inotify")
WALK_BUDGET = 10.0  # seconds spent counting folders and files below the sources


@dataclass
class _Tree:
    files: int = 0
    dirs: int = 0
    unreadable: list[str] | None = None
    truncated: bool = False


def _walk(base: str, recursive: bool, deadline: float) -> _Tree:
    tree = _Tree(unreadable=[])
    assert tree.unreadable is not None
    stack = [base]
    while stack:
        if time.monotonic() > deadline:
            tree.truncated = True
            break
        d = stack.pop()
        tree.dirs += 1
        try:
            entries = list(os.scandir(d))
        except PermissionError:
            tree.unreadable.append(d + "/")
            continue
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        stack.append(e.path)
                elif e.is_file():
                    tree.files += 1
                    if not os.access(e.path, os.R_OK):
                        tree.unreadable.append(e.path)
            except OSError:
                continue
    return tree


def check_sources(config: Any) -> tuple[list[Finding], int, int, list[Any]]:
    """Findings, folders to watch, inotify instances needed, roots."""
    from ..errors import SourceError
    from ..sources import make_roots

    out: list[Finding] = []
    try:
        roots = make_roots(list(config.sources.paths), must_exist=False)
    except SourceError as e:
        return [Finding("sources", "fail", str(e), "fix [sources] paths")], 0, 0, []
    dirs = 0
    deadline = time.monotonic() + WALK_BUDGET
    for root in roots:
        if root.kind == "glob" and not glob.glob(root.path, recursive=True):
            out.append(
                Finding(
                    "sources",
                    "warn",
                    f"{root.spec}: matches nothing yet (followed once something matches)",
                    "check the pattern in [sources] paths",
                )
            )
            continue
        base = root.base if root.kind != "file" else root.path
        if not os.path.exists(base):
            out.append(
                Finding(
                    "sources",
                    "warn",
                    f"{root.spec}: does not exist yet (followed once it appears)",
                    "create it, or fix [sources] paths",
                )
            )
            continue
        if root.kind == "file":
            ok = os.access(root.path, os.R_OK)
            dirs += 1
            out.append(
                Finding("sources", "ok", f"{root.spec}: a readable file")
                if ok
                else Finding(
                    "sources",
                    "fail",
                    f"{root.spec}: not readable by {current_user()}",
                    f"setfacl -m u:nanwatch:r {root.path} (or add nanwatch to its group)",
                )
            )
            continue
        tree = _walk(root.base, True, deadline)
        dirs += tree.dirs
        more = " (stopped counting: the walk took too long)" if tree.truncated else ""
        if tree.unreadable:
            shown = ", ".join(tree.unreadable[:3])
            out.append(
                Finding(
                    "sources",
                    "fail",
                    f"{root.spec}: {len(tree.unreadable)} of {tree.files} file(s) or folders not "
                    f"readable by {current_user()}, e.g. {shown}",
                    f"setfacl -R -m u:nanwatch:rX,d:u:nanwatch:rX {root.base} (or add the "
                    "service user to the owning group: SupplementaryGroups= in a drop-in)",
                )
            )
        else:
            out.append(
                Finding(
                    "sources",
                    "ok",
                    f"{root.spec}: {tree.files} file(s) in {tree.dirs} folder(s), all "
                    f"readable{more}{as_root_note()}",
                )
            )
    instances = len({r.base for r in roots})
    return out, dirs, instances, roots


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def inotify_usage(uid: int) -> tuple[int, int] | None:
    """(watches, instances) held by the processes of ``uid`` that this user may inspect."""
    watches = instances = 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:inotify":
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
                    watches += sum(1 for line in f if line.startswith("inotify wd:"))
                instances += 1
            except OSError:
                continue
    return watches, instances


def inotify_verdict(
    need_watches: int,
    need_instances: int,
    max_watches: int | None,
    max_instances: int | None,
    used: tuple[int, int] | None,
) -> Finding:
    """Enough inotify watches and instances for the folders to follow, beside current use?"""
    if max_watches is None or max_instances is None:
        return Finding(
            "inotify",
            "warn",
            f"cannot read {INOTIFY}: limits unknown",
            "run doctor on the node itself",
        )
    uw, ui = used or (0, 0)
    in_use = f" ({uw} watches, {ui} instances already in use by the service user)" if used else ""
    short = []
    if need_watches + uw > max_watches:
        want = max(524288, 1 << (2 * (need_watches + uw)).bit_length())
        short.append(
            (
                f"fs.inotify.max_user_watches = {max_watches} is below the {need_watches} "
                "folder(s) to watch",
                f"fs.inotify.max_user_watches={want}",
            )
        )
    if need_instances + ui > max_instances:
        want = max(1024, 2 * (need_instances + ui))
        short.append(
            (
                f"fs.inotify.max_user_instances = {max_instances} is below the {need_instances} "
                "watch(es) to start",
                f"fs.inotify.max_user_instances={want}",
            )
        )
    if not short:
        return Finding(
            "inotify",
            "ok",
            f"{need_watches} folder(s) to watch, {need_instances} instance(s); limits "
            f"{max_watches} watches, {max_instances} instances{in_use}",
        )
    settings = " ".join(s for _, s in short)
    return Finding(
        "inotify",
        "warn",
        "; ".join(m for m, _ in short) + f"{in_use}: polling will be used where watches fail "
        "(slower to notice, more CPU)",
        f"sysctl -w {settings} and persist it: printf '%s\\n' {settings} > "
        "/etc/sysctl.d/90-nanwatch.conf",
    )


def check_inotify(need_watches: int, need_instances: int) -> Finding:
    uid = os.geteuid()
    try:
        import pwd

        uid = pwd.getpwnam("nanwatch").pw_uid
    except (ImportError, KeyError):
        pass
    return inotify_verdict(
        need_watches,
        need_instances,
        _read_int(INOTIFY / "max_user_watches"),
        _read_int(INOTIFY / "max_user_instances"),
        inotify_usage(uid),
    )


def check_filesystems(config: Any, roots: list[Any]) -> list[Finding]:
    from ..sources.watcher import NETWORK_FS, filesystem_type

    out = []
    mode = config.sources.mode
    for r in roots:
        base = r.base if os.path.exists(r.base) else os.path.dirname(r.base)
        fs = filesystem_type(base) or "unknown"
        remote = fs in NETWORK_FS
        if remote and mode == "inotify":
            out.append(
                Finding(
                    "filesystem",
                    "warn",
                    f"{r.spec}: on {fs}, but [sources] mode = 'inotify': writes made by other "
                    "hosts are never noticed until the next 30s check",
                    "set [sources] mode = 'auto' (polls network filesystems)",
                )
            )
        elif remote or mode == "poll":
            why = f"{fs} is a network filesystem" if remote else "[sources] mode = 'poll'"
            out.append(
                Finding(
                    "filesystem",
                    "ok",
                    f"{r.spec}: on {fs}; polled every {config.sources.poll_interval:g}s ({why})",
                )
            )
        else:
            out.append(Finding("filesystem", "ok", f"{r.spec}: on {fs}; inotify"))
    return out
