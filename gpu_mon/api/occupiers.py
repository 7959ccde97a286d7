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

Its owner may still write anything into a live occupier's record: each field is checked (type, size, range:
a time in 1970..2100, finite) and only the fields an occupier writes are kept; a record with a field that
is not what an occupier writes is listed as `{"uid", "pid", "user", "unreadable": WHY}`, never shown as if
it were one (every reader of the registry, root's `gpu-mon status` among them, would otherwise crash on it).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon.api import procfs

REGISTRY = "/tmp/gpu-mon-occupiers"
# Honoured only for root (who can edit the system config anyway): a plain user's occupier always
# registers in REGISTRY, so that it counts towards [occupy] max_gpus_per_user.
REGISTRY_ENV = "GPU_MON_OCCUPIERS_DIR"
_NAME_RE = re.compile(r"^([0-9]+)-([0-9]+)\.json$")
_MAX_RECORD = 65536
_LATEST_WALL = 4102444800.0  # 2100-01-01: a later time is not one an occupier wrote
_MAX_GPUS = 256  # GPUs named in a record
_MAX_GPU_TEXT = 128  # characters of one GPU's name (an index or a UUID)
_MAX_TEXT = 4096  # characters of `runs` (the occupier's command)
_MAX_PHASE = 32  # characters of `phase` (waiting, occupying, yielded)


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
    return sorted(found, key=lambda r: (r.get("started_wall") or 0, r["pid"]))  # (both checked: numbers)


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
    user = procfs.user_name(uid)
    why = unreadable(doc)
    if why:
        return {"uid": uid, "pid": pid, "user": user, "unreadable": why}
    return {**{k: v for k, v in doc.items() if k in _FIELDS}, "user": user}


def _wall(v: object) -> bool:
    return v is None or (_number(v) and 0 <= v <= _LATEST_WALL)  # type: ignore[operator]


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_GPUS)


def _gpus(v: object) -> bool:
    return isinstance(v, list) and len(v) <= _MAX_GPUS and all(_short(g, _MAX_GPU_TEXT) for g in v)


def _short(v: object, most: int) -> bool:
    return isinstance(v, str) and len(v) <= most


def _hours(v: object) -> bool:
    return v is None or (_number(v) and 0 <= v <= 1e6)  # type: ignore[operator]


_FIELDS: Dict[str, Callable[[object], bool]] = {
    "uid": lambda v: isinstance(v, int),
    "pid": lambda v: isinstance(v, int),
    "start_ticks": lambda v: isinstance(v, int),
    "started_wall": _wall,
    "since_wall": _wall,
    "gpus_asked": _gpus,
    "gpus": _gpus,
    "gpu_count": _count,
    "polite": lambda v: isinstance(v, bool),
    "runs": lambda v: _short(v, _MAX_TEXT),
    "max_hold_hours": _hours,
    "phase": lambda v: _short(v, _MAX_PHASE),
}


def unreadable(doc: dict) -> str:
    """Why a record is not one an occupier wrote (the first field that is not what it writes); "" when
    it is."""
    for key, fits in _FIELDS.items():
        if key in doc and not fits(doc[key]):
            return f"{key} is not what an occupier writes"
    return ""


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
