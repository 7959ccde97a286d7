"""Small, fast readers of /proc/PID files. Every reader returns None for a process that has vanished."""

from __future__ import annotations

import contextlib
import os
import pwd
import time
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Set, Tuple

PROC = "/proc"


class ProcStat(NamedTuple):
    """The fields of /proc/PID/stat that gpu_mon uses. (A NamedTuple, not a dataclass: the workload leader
    reads them, and starts without loading dataclasses and inspect.)"""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    sid: int
    start_ticks: int
    flags: int = 0

    @property
    def kernel_thread(self) -> bool:
        """A kernel thread (PF_KTHREAD): it has no files of its own to hold a GPU with."""
        return bool(self.flags & 0x00200000)


def read_stat(pid: int, proc: str = PROC) -> Optional[ProcStat]:
    """Parse /proc/PID/stat; the name may hold spaces, parentheses or newlines, so split at the last ')'."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    left, right = data.find(b"("), data.rfind(b")")
    if left < 0 or right < left:
        return None
    fields = data[right + 2 :].split()
    try:
        return ProcStat(
            pid=pid,
            comm=data[left + 1 : right].decode("utf-8", "backslashreplace"),
            state=fields[0].decode("ascii", "replace"),
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            sid=int(fields[3]),
            start_ticks=int(fields[19]),
            flags=int(fields[6]),
        )
    except (IndexError, ValueError):
        return None


def read_ran(pid: int, proc: str = PROC) -> Optional[Tuple[int, int]]:
    """(ns run, times scheduled in) of a process's main thread (/proc/PID/schedstat): both grow whenever it
    runs at all, so equal readings mean it has not run in between; None if unreadable."""
    try:
        fd = os.open(f"{proc}/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fields = os.read(fd, 128).split()
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(fields[0]), int(fields[2])
    except (IndexError, ValueError):
        return None


def read_argv0(pid: int, proc: str = PROC) -> str:
    """Basename of argv[0], or '' (kernel threads, vanished processes, unreadable)."""
    try:
        with open(f"{proc}/{pid}/cmdline", "rb") as f:
            data = f.read(4096)
    except OSError:
        return ""
    argv0 = data.split(b"\0", 1)[0].decode("utf-8", "backslashreplace")
    return os.path.basename(argv0)


def read_uid(pid: int, proc: str = PROC) -> Optional[int]:
    """Owner of /proc/PID: the process's effective uid (for a dumpable process)."""
    try:
        return os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None


def list_pids(proc: str = PROC) -> Iterator[str]:
    """The pid directories of /proc, as strings."""
    try:
        names = os.listdir(proc)
    except OSError:
        return iter(())
    return filter(str.isdigit, names)


def last_pid(proc: str = PROC) -> Optional[int]:
    """The pid the kernel handed out last (the last field of /proc/loadavg), or None."""
    try:
        with open(f"{proc}/loadavg", "rb") as f:
            return int(f.read(128).split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def newest_first(pids: Iterable[int], last: Optional[int]) -> List[int]:
    """Pids in the order they were handed out, the newest first: down from `last` (the pid given out last),
    then down from the top (those came before the counter wrapped round). Without `last`, highest first."""
    ordered = sorted(pids, reverse=True)
    if last is None:
        return ordered
    cut = next((i for i, p in enumerate(ordered) if p <= last), len(ordered))
    return ordered[cut:] + ordered[:cut]


def display_name(comm: str, argv0: str) -> str:
    """comm, or argv[0]'s basename when the kernel cut comm at 15 characters (as `ps` and psutil do)."""
    if len(comm) >= 15 and argv0.startswith(comm):
        return argv0
    return comm


_USERS: Dict[int, Tuple[str, float]] = {}
_USER_TTL_SECONDS = 300.0


def user_name(uid: Optional[int]) -> str:
    """Login name for a uid (cached for a few minutes), the number when it has none, '?' when unknown."""
    if uid is None:
        return "?"
    now = time.monotonic()
    hit = _USERS.get(uid)
    if hit and now - hit[1] < _USER_TTL_SECONDS:
        return hit[0]
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    _USERS[uid] = (name, now)
    return name


def ancestors(pid: int, proc: str = PROC, limit: int = 64) -> Iterator[int]:
    """Parent, grandparent, ... of a process, up to init (bounded, in case of a loop in a fake /proc)."""
    seen = 0
    while seen < limit:
        st = read_stat(pid, proc)
        if st is None or st.ppid <= 0:
            return
        yield st.ppid
        if st.ppid == 1:
            return
        pid = st.ppid
        seen += 1


def descendants(root: int, proc: str = PROC, skip: Optional[Set[int]] = None) -> Dict[int, int]:
    """Every descendant of `root` as {pid: start_ticks}, by walking ppid links of all processes; the
    processes in `skip` and their subtrees are left out."""
    children: Dict[int, list] = {}
    starts: Dict[int, int] = {}
    for name in list_pids(proc):
        st = read_stat(int(name), proc)
        if st is None:
            continue
        children.setdefault(st.ppid, []).append(st.pid)
        starts[st.pid] = st.start_ticks
    out: Dict[int, int] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in out or (skip and pid in skip):
            continue
        out[pid] = starts[pid]
        todo.extend(children.get(pid, ()))
    return out


def children(pid: int, proc: str = PROC) -> List[int]:
    """Direct children of a process, from /proc/PID/task/TID/children (every thread's list)."""
    out: List[int] = []
    try:
        tasks = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        with contextlib.suppress(OSError, ValueError), open(f"{proc}/{pid}/task/{tid}/children") as f:
            out.extend(int(x) for x in f.read().split())
    return out


def subtree(root: int, proc: str = PROC, limit: int = 100_000) -> Set[int]:
    """`root` and every live descendant, walking children lists down from it: the cost is the size of the
    tree, not of /proc (`descendants` reads every process). Escaped processes (setsid, double fork) stay in
    it when `root` is a child subreaper."""
    out: Set[int] = set()
    todo = [root] if os.path.isdir(f"{proc}/{root}") else []
    while todo and len(out) < limit:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children(pid, proc))
    return out
