"""A hook (`--notify`) contained as a workload is, where jobs are gpu-mon's own children (the direct
launcher): under a leader of its own (workloads/leader.py), which runs the hook's wrapper as its user.

The leader is a child subreaper, so whatever the hook starts stays its descendant, even after `setsid` and
a double fork; it ends them all:
- when the hook's main process exits: SIGTERM (and SIGCONT) to every one left at once, SIGKILL KILL_AFTER
  later, as at a job's end (a hook's leftovers never run on, nor hold a GPU, after it);
- at the hook's limit and when gpu-mon stops: the loop kills every descendant of the leader (`kill`),
  then the leader;
- when gpu-mon dies (even by SIGKILL): its parent-death signal, the same steps by itself.
The leader exits once nothing of the hook is left, with the main process's exit status: the process the
loop polls.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable, Dict, List, Tuple

from gpu_mon.engine.workloads import linux
from gpu_mon.engine.workloads.supervisor import send_spec, spawn_leader
from gpu_mon.queue.hooks import KILL_AFTER
from gpu_mon.queue.jobs import Job


class LeaderReach:
    """Every process a hook's leader has under it (its descendants, the leader excepted)."""

    def __init__(self, leader: int) -> None:
        self.leader = leader  # our unreaped child: its pid cannot be another's

    def signal(self, sig: int) -> bool:
        """`sig` to the descendants that left the leader's group (the group has it from the caller)."""
        linux.kill_tree(self.leader, sig, told_group=self.leader)
        return True

    def kill(self) -> bool:
        """SIGKILL every descendant until none is left; False when some may be (try again)."""
        return linux.kill_until_gone(self.leader)


class LeaderHooks:
    """Starts each hook under a leader; `groups_of(uid, gid)`: the user's supplementary groups."""

    def __init__(self, groups_of: Callable[[int, int], Tuple[int, ...]]) -> None:
        self.groups_of = groups_of

    def hook(
        self, job: Job, argv: List[str], env: Dict[str, str], seconds: float
    ) -> Tuple[subprocess.Popen, LeaderReach]:
        """Start the hook (hooks.py's `launch`; its own limit is the loop's and the wrapper's `timeout`):
        the leader, and what reaches all of the hook. OSError when it cannot be started."""
        _executable(argv, env)
        root = os.geteuid() == 0
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            popen = spawn_leader(f"hook {job.id}", devnull, devnull, ())
        finally:
            os.close(devnull)
        spec = {
            "argv": argv,
            "dir": "/",  # (the wrapper goes to the job's directory, as the user)
            "env": env,
            "uid": job.uid,
            "gid": job.gid,
            "groups": list(self.groups_of(job.uid, job.gid)) if root else [],
            "switch_user": root,
            "status_fd": 1,  # (what it reports is not read: its exit status is the hook's)
            "daemon_pid": os.getpid(),
            "stop_signal": int(signal.SIGTERM),
            "stop_timeout_seconds": KILL_AFTER,
        }
        send_spec(popen, spec)
        return popen, LeaderReach(popen.pid)


def _executable(argv: List[str], env: Dict[str, str]) -> None:
    """ValueError, as subprocess's own start would raise, for what exec cannot take (a NUL, a surrogate
    that stands for no byte): said before a leader is started, not as its exit status 126."""
    for text in (*argv, *env, *env.values()):
        if b"\0" in os.fsencode(text):  # (UnicodeEncodeError, a ValueError: surrogates not allowed)
            raise ValueError("embedded null byte")
