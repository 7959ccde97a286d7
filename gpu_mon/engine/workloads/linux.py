"""The Linux calls that workload containment needs: prctl, pidfd signals, children lists, tree kills.

Standard library and gpu_mon.api.procfs only: the leader (leader.py) imports this module, and it must start
in tens of milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Iterable, Optional, Set

from gpu_mon.api import procfs

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, arg: int) -> None:
    """prctl(option, arg); OSError on failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_name(name: bytes) -> None:
    """The name `ps` and /proc/PID/comm show (15 bytes at most)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def signal_pid(pid: int, start_ticks: Optional[int], sig: int) -> bool:
    """Signal one process through a pidfd, only if it is still the process that started at `start_ticks`."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        if start_ticks is not None:
            st = procfs.read_stat(pid)
            if st is None or st.start_ticks != start_ticks or st.state in ("Z", "X"):
                return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def kill_tree(
    root: int, sig: int, skip: Iterable[int] = (), proc: str = procfs.PROC, told_group: Optional[int] = None
) -> int:
    """Send `sig` to every descendant of `root` (outside the subtrees of `skip`, and not to those still in
    process group `told_group`, which had it already); return how many."""
    count = 0
    for pid, start in procfs.descendants(root, proc, skip=set(skip)).items():
        if told_group is not None and _group_of(pid) == told_group:
            continue
        if signal_pid(pid, start, sig):
            count += 1
    return count


def _group_of(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def kill_until_gone(
    root: int, skip: Iterable[int] = (), budget_seconds: float = 0.2, quiet_passes: int = 3
) -> bool:
    """SIGKILL every descendant of `root`, again and again, until none is left; False if some remain.

    Without a cgroup this is the only way to reach processes that left the workload's session: they are
    still our descendants, because the leader (and the daemon) are child subreapers. Each pass first kills
    the direct children (orphans come back to us there) and then the whole tree. A pass reads /proc one
    process at a time, so a process that forks and exits in a loop can be gone from what it listed and its
    child not yet in it: done means `quiet_passes` passes in a row that found no live descendant at all
    (not merely none that could still be signalled). The caller tries again later on False.
    """
    skipped: Set[int] = set(skip)
    deadline = time.monotonic() + budget_seconds
    quiet = 0
    while True:
        quiet = 0 if _kill_pass(root, skipped) else quiet + 1
        if quiet >= quiet_passes:
            return True
        if time.monotonic() > deadline:
            return False


def _kill_pass(root: int, skipped: Set[int]) -> bool:
    """One pass of kill_until_gone: whether it saw any live descendant (each one seen is sent SIGKILL).

    Never a pid reused by a stranger: a children list or a walk of /proc names pids, not processes, and
    `root` (a leader, reaping its own children while the daemon kills them) may reap one between that look
    and the signal, its pid then free for any process of the machine. So each is signalled only through a
    pidfd (signal_pid), and only while its start time is still the one read in the same /proc/PID/stat
    that showed it a descendant of `root` (a direct child: its ppid there is `root`)."""
    seen = False
    for pid in procfs.children(root):
        st = procfs.read_stat(pid) if pid not in skipped else None
        if st is not None and st.ppid == root and st.state not in ("Z", "X"):
            seen = True
            signal_pid(pid, st.start_ticks, signal.SIGKILL)
    for pid, start in procfs.descendants(root, skip=skipped).items():
        if _live(pid):
            seen = True
            signal_pid(pid, start, signal.SIGKILL)
    return seen


def _live(pid: int) -> bool:
    """Not a zombie (whose reaping is the parent's business) and not gone."""
    st = procfs.read_stat(pid)
    return st is not None and st.state not in ("Z", "X")
