"""Every user's `gpu-mon occupy` occupier on this host, readable by anyone, forgeable by no one.

Each occupier keeps one record, `UID-PID.json`, in a world-writable sticky directory (like /tmp itself: anyone
may add a file, only its owner may change or remove it). Only root makes that directory (at boot, from
systemd/gpu-mon.tmpfiles; or a root occupier): one that another user made or could change (not root's, or
writable by others without the sticky bit) is not trusted: its owner could remove or replace anyone's record,
so nothing is written there and nothing in it is believed.

Who a record belongs to is the file's owner as the kernel reports it, never what the file says: a record
is believed only when its owner, the uid in its name and the uid it claims agree, and its pid is still the
process that wrote it (same start time, same owner). Anything else is skipped. Records of occupiers killed
with SIGKILL stay until their owner's next occupier removes them; a dead pid is never shown.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import List, Optional, Tuple

from gpu_mon.api import procfs

REGISTRY = "/tmp/gpu-mon-occupiers"
# Honoured only for root (who can edit the system config anyway): a plain user's occupier always
# registers in REGISTRY, so that it counts towards [occupy] max_gpus_per_user.
REGISTRY_ENV = "GPU_MON_OCCUPIERS_DIR"
_NAME_RE = re.compile(r"^([0-9]+)-([0-9]+)\.json$")
_MAX_RECORD = 65536


def registry_dir() -> str:
    """Where records live: REGISTRY, or $GPU_MON_OCCUPIERS_DIR when running as root."""
    if os.getuid() == 0 and os.geteuid() == 0:
        return os.environ.get(REGISTRY_ENV) or REGISTRY
    return REGISTRY


def record_name(uid: int, pid: int) -> str:
    """The file name of an occupier's record."""
    return f"{uid}-{pid}.json"


def registry_problem(directory: str) -> Optional[str]:
    """Why the registry cannot be trusted, in one phrase; None when it is root's and no one else may remove
    or replace its records (or it does not exist: then it holds nothing to believe)."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"{directory}: {err.strerror or err}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    fix = "root must remove it; systemd-tmpfiles --create makes it again, 1777 root:root"
    if st.st_uid != 0:
        owner = procfs.user_name(st.st_uid)
        return f"{directory} is owned by {owner}, not root, who may remove any record ({fix})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"{directory} is writable by others and not sticky: anyone may remove any record ({fix})"
    return None


def list_occupiers(directory: Optional[str] = None, proc: str = procfs.PROC) -> List[dict]:
    """The live occupiers' records (each with `user` set from the file's owner), oldest first; none from a
    registry that is not trusted (registry_problem)."""
    directory = directory or registry_dir()
    if registry_problem(directory):
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [r for r in (_believed(directory, n, proc) for n in sorted(names)) if r is not None]
    return sorted(found, key=lambda r: (r.get("started_wall") or 0, r["pid"]))


def stale_records(directory: str, uid: int, proc: str = procfs.PROC) -> List[str]:
    """Paths of `uid`'s records whose occupier is gone (for that user to remove)."""
    out: List[str] = []
    if registry_problem(directory):
        return out
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        match = _NAME_RE.match(name)
        if match and int(match.group(1)) == uid and _believed(directory, name, proc) is None:
            out.append(os.path.join(directory, name))
    return out


def _believed(directory: str, name: str, proc: str) -> Optional[dict]:
    match = _NAME_RE.match(name)
    if not match:
        return None
    uid, pid = int(match.group(1)), int(match.group(2))
    found = _read(os.path.join(directory, name))
    if found is None:
        return None
    owner, doc = found
    if owner != uid or doc.get("uid") != uid or doc.get("pid") != pid:
        return None
    if not _live(pid, doc.get("start_ticks"), uid, proc):
        return None
    doc["user"] = procfs.user_name(uid)
    return doc


def _read(path: str) -> Optional[Tuple[int, dict]]:
    """(owner uid, record) of a regular file, never through a symlink; None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
            return None
        doc = json.loads(os.read(fd, _MAX_RECORD).decode("utf-8"))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return (st.st_uid, doc) if isinstance(doc, dict) else None


def _live(pid: int, start_ticks: object, uid: int, proc: str) -> bool:
    st = procfs.read_stat(pid, proc)
    if st is None or st.start_ticks != start_ticks or st.state in ("Z", "X"):
        return False
    return procfs.read_uid(pid, proc) == uid
