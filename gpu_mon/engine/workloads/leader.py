"""The leader: one small process per workload, between the daemon and the workload's command.

Why it exists: PR_SET_PDEATHSIG reaches only the direct child of a dying process, so if gpu_mon is killed
(even by SIGKILL) someone must take the workload's grandchildren down with it. The leader is the session and
process-group leader of its workload and a child subreaper (orphaned descendants come back to it, so even
those that escaped with setsid are found); it gets SIGTERM when the daemon dies, and it never exits while a
descendant lives, so the daemon can always signal the group by the leader's pid without PID reuse.

Protocol: the daemon writes a JSON spec to the leader's stdin and closes it; the leader reports on the
status fd named in the spec, one line each: `started PID`, `error MESSAGE`. The exit status of the leader is
the workload's (128 + signal when killed; 127/126 when the command cannot be run).

It imports only the standard library and gpu_mon.procfs, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from gpu_mon.api import procfs

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD}


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _set_name(name: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


class Leader:
    """Runs one workload command and makes sure nothing of it outlives a stop."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.status_fd: int = int(spec["status_fd"])
        self.stop_timeout: float = float(spec["stop_timeout_seconds"])
        self.child: Optional[subprocess.Popen] = None
        self.main_status: Optional[int] = None
        self.deadline: Optional[float] = None
        self.killed = False

    def report(self, line: str) -> None:
        """One line to the daemon; a gone daemon is not an error here (we are stopping anyway)."""
        with contextlib.suppress(OSError):
            os.write(self.status_fd, (line.replace("\n", " ") + "\n").encode("utf-8", "backslashreplace"))

    def start(self) -> Optional[int]:
        """Start the command; return an exit code when it cannot be started."""
        s = self.spec
        kwargs: dict = {}
        if s.get("switch_user"):
            kwargs.update(user=s["uid"], group=s["gid"], extra_groups=list(s["groups"]))
        try:
            self.child = subprocess.Popen(
                s["argv"],
                cwd=s["dir"],
                env=s["env"],
                stdin=subprocess.DEVNULL,
                close_fds=True,
                preexec_fn=_unblock_signals,
                restore_signals=True,
                **kwargs,
            )
        except FileNotFoundError as err:
            where = f"directory {s['dir']!r}" if err.filename == s["dir"] else f"command {s['argv'][0]!r}"
            self.report(f"error cannot start: {where}: {err.strerror}")
            return 127
        except PermissionError as err:
            self.report(f"error cannot start {s['argv'][0]!r}: {err.strerror}")
            return 126
        except (OSError, ValueError, subprocess.SubprocessError) as err:
            self.report(f"error cannot start {s['argv'][0]!r}: {err}")
            return 126
        self.report(f"started {self.child.pid}")
        return None

    def signal_all(self, sig: int) -> int:
        """Signal every live descendant (group members and escaped ones alike); return how many."""
        count = 0
        for pid, start in procfs.descendants(os.getpid()).items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                st = procfs.read_stat(pid)
                if st is not None and st.start_ticks == start and st.state != "Z":
                    signal.pidfd_send_signal(fd, sig)
                    count += 1
            except OSError:
                pass
            finally:
                os.close(fd)
        return count

    def begin_stop(self) -> None:
        """SIGTERM to everything; SIGKILL after the stop timeout."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.stop_timeout
        self.signal_all(signal.SIGTERM)

    def reap(self) -> bool:
        """Reap every exited child; return False once we have no children left."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if self.child is not None and pid == self.child.pid:
                self.child.returncode = 0  # stop Popen from waiting on it again
                self.main_status = status

    def run(self) -> int:
        """Wait for signals and children until nothing of the workload is left; return the exit code."""
        while True:
            have_children = self.reap()
            if self.main_status is not None and self.deadline is None:
                self.begin_stop()  # the command ended: its leftovers must not keep the GPU
            if not have_children:
                break
            timeout: Optional[float] = None
            if self.deadline is not None:
                timeout = self.deadline - time.monotonic()
                if timeout <= 0:
                    self.killed = True
                    self.signal_all(signal.SIGKILL)  # again every 0.2 s until nothing is left
                    timeout = 0.2
            info = (
                signal.sigtimedwait(_SIGNALS, timeout)
                if timeout is not None
                else signal.sigwaitinfo(_SIGNALS)
            )
            if info is not None and info.si_signo != signal.SIGCHLD:
                self.begin_stop()
        return _exit_code(self.main_status)


def _exit_code(status: Optional[int]) -> int:
    if status is None:
        return 1
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _unblock_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def main() -> int:
    """Entry point: read the spec from stdin, guard against the daemon dying, run the workload."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(spec["daemon_pid"]):
        return 1  # the daemon died before we could ask to be told; there is nothing to run for
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _set_name(b"gpu-mon-leader")
    leader = Leader(spec)
    failed = leader.start()
    if failed is not None:
        return failed
    return leader.run()


if __name__ == "__main__":
    sys.exit(main())
