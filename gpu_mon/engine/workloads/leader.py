"""The leader: one small process per workload, between the daemon and the workload's command.

Why it exists: PR_SET_PDEATHSIG reaches only the direct child of a dying process, so if gpu_mon is killed
(even by SIGKILL) someone must take the workload's grandchildren down with it. The leader is the session and
process-group leader of its workload and a child subreaper (orphaned descendants come back to it, so even
those that escaped with setsid are found); it gets DAEMON_GONE when the daemon dies, and it never exits while
a descendant lives, so the daemon can always signal the group by the leader's pid without PID reuse.

Stopping: while the daemon lives it drives a stop (stopping.py): the workload's `stop_signal` to the main
process group (the leader leaves it blocked; with `stop_main_only` the daemon sends the leader MAIN_STOP
instead, and the leader sends the stop signal to the main process alone), then SIGTERM, which the leader also
passes (with SIGCONT, for stopped ones) to every descendant, then SIGKILL. The leader's own SIGKILL comes a
second after the daemon's, as a backstop. When the daemon has died (the leader gets DAEMON_GONE as its
parent-death signal), the leader runs the same steps itself with the full grace. SIGKILL: with a cgroup (the
daemon moved the leader into the workload's group before sending the spec) by writing `cgroup.kill`, which
takes the leader too; without one, by killing every descendant again and again until none is left.

Protocol: the daemon writes a JSON spec to the leader's stdin and closes it; the leader reports on the
status fd named in the spec, one line each: `started PID`, `exit STATUS` (the command's wait status, when it
ends), `error MESSAGE`. The exit status of the leader is the workload's (128 + signal when killed; 127/126
when the command cannot be run).

A transient unit (`unit_cgroup` in the spec, transient.py): the command is `systemd-run --wait`, and the
workload's processes are the unit's, not ours. Every step of a stop then goes to the processes in the unit's
group (never to the client, whose exit is the unit's end), the SIGKILL is the group's `cgroup.kill`, and
the leader stays until the group is empty. When the daemon dies, the unit outlives it: the leader arms the
guard (unguarded.py: systemd stops the jobs if no daemon comes back in time), ends its client (never the
unit) and exits; the next daemon finds the unit again (queue/adopt.py).

It imports only the standard library, gpu_mon.api.procfs and linux.py, so it starts in tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from gpu_mon.engine.workloads import cgroups, ends, linux, unguarded

# The parent-death signal: only the kernel sends it, when the daemon's thread that started us exits (the
# daemon is dying). A real-time signal, so that it is never a workload's stop_signal sent to the group, nor
# the daemon's SIGTERM step: asking whether the daemon is alive (getppid) instead was racy, as the kernel
# hands us to the dying daemon's other threads first.
DAEMON_GONE = signal.SIGRTMIN
# From the daemon: send the stop signal to the main process alone (`stop_main_only`); only we may, as only
# we reap it (its pid cannot be another process's while we have not).
MAIN_STOP = signal.SIGRTMIN + 1
_SIGNALS = {signal.SIGTERM, signal.SIGCHLD, DAEMON_GONE, MAIN_STOP}
# Blocked and never taken, so a stray signal cannot kill the leader and orphan its workload, and a workload's
# stop_signal sent to its process group reaches the command only; the command gets them unblocked again.
# Every signal but those the leader takes: a stop signal whose default action kills (SIGSEGV, SIGRTMIN+2: a
# queue's door refuses them now, an older one let them in) took the leader down with the group's, and the
# job lost its grace. (A fault of the leader's own still ends it: the kernel unblocks that one.)
_STRAY = set(signal.valid_signals()) - _SIGNALS - {signal.SIGKILL, signal.SIGSTOP}
_TERM_STEP_SECONDS = 1.0  # as stopping.TERM_STEP_SECONDS (not imported: the leader starts on little)


class Leader:
    """Runs one workload command and makes sure nothing of it outlives a stop."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.status_fd: int = int(spec["status_fd"])
        self.stop_timeout: float = float(spec["stop_timeout_seconds"])
        self.stop_signal = int(spec.get("stop_signal", signal.SIGTERM))
        self.main_only = bool(spec.get("stop_main_only"))
        self.daemon_pid = int(spec.get("daemon_pid", 0))
        self.main_signalled = False  # the stop signal went to the main process (MAIN_STOP)
        self.note_fd: Optional[int] = None  # the command's stderr until it redirects it (`note_stderr`)
        self.term_pending = False  # the stop signal was not SIGTERM: SIGTERM comes when its grace is over
        self.cgroup: Optional[str] = spec.get("cgroup")
        self.unit: Optional[str] = spec.get("unit_cgroup")
        self.guard: Optional[float] = spec.get("unit_guard_seconds")  # unguarded.py, as the daemon dies
        self.unit_kills = 0  # SIGKILL rounds on a unit's group that is still populated
        self.child: Optional[subprocess.Popen] = None
        self.main_status: Optional[int] = None
        self.deadline: Optional[float] = None
        self.killed = False
        # A queue job's end record (ends.py): written as the command ends, before the daemon is told
        self.end_file: Optional[str] = spec.get("end_file")
        self.daemon_gone = False  # the daemon died before the command ended: its end is not its own
        self.unit_said = ""  # what systemd-run said on its stderr (a unit's: read as it ends)

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
        note_w = None
        if s.get("note_stderr") or (self.unit and self.end_file):
            # What the command says on stderr before it sends it elsewhere (a queue job's wrapper: why its
            # output file cannot be opened) is read when it ends, and becomes the workload's `error` line.
            self.note_fd, note_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            os.set_blocking(note_w, True)
            kwargs.update(stderr=note_w)
        try:
            self.child = subprocess.Popen(
                s["argv"],
                cwd=s["dir"],
                env=s["env"],
                stdin=subprocess.DEVNULL if s.get("stdin_fd") is None else int(s["stdin_fd"]),
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
        finally:
            if note_w is not None:
                os.close(note_w)
        self.report(f"started {self.child.pid}")
        # A stop signal sent to the group before the command existed (or while it was being started)
        # reached only us (blocked, and never taken): taken here, once the command runs, it is passed on
        # (else the command never sees it, and is killed at the end of its grace instead: a restart of
        # gpu-mon just after a workload's start lost its checkpoint signal so). SIGTERM is taken by `run`.
        early = self.stop_signal in _STRAY and signal.sigtimedwait({self.stop_signal}, 0) is not None
        if early:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpid(), self.stop_signal)  # (blocked here: the command's, only)
        return None

    def begin_stop(self, daemon_alive: bool = True, group_told: bool = False) -> None:
        """SIGTERM, then SIGCONT (a stopped process must wake to see it), to every descendant; or, when the
        daemon has died and the workload has a stop signal of its own, that signal to the group first.
        group_told: the daemon sent the SIGTERM to the whole process group (the leader got it as one of
        the group), so only descendants that left the group get it from here: a second SIGTERM can cut a
        checkpoint short, and one that lands while a Python command is exiting from its handler of the
        first kills it (Python restores SIG_DFL as it finalizes), so a clean `exit 143` became a death."""
        if self.deadline is None:
            # While the daemon lives it escalates (and says so); we follow a second later, as a backstop.
            backstop = 1.0 if daemon_alive and self.main_status is None else 0.0
            self.deadline = time.monotonic() + self.stop_timeout + backstop
            first = self.stop_signal != signal.SIGTERM or self.main_only
            if not daemon_alive and self.main_status is None and first:
                self.term_pending = True
                if self.unit:
                    cgroups.signal_all(self.unit, self.stop_signal)
                    cgroups.signal_all(self.unit, signal.SIGCONT)
                    return
                if self.main_only:
                    self.signal_main()
                    return
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(os.getpid(), self.stop_signal)
                    os.killpg(os.getpid(), signal.SIGCONT)
                return
        elif not daemon_alive:
            return  # told again (the kernel signals once per dying thread of the daemon): nothing new
        self.term_all(outside_group=group_told)

    def signal_main(self) -> None:
        """The stop signal (and SIGCONT) to the main process alone, once; not after it has ended."""
        if self.child is None or self.main_status is not None or self.main_signalled:
            return
        self.main_signalled = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child.pid, self.stop_signal)
            os.kill(self.child.pid, signal.SIGCONT)

    def term_all(self, outside_group: bool = False) -> None:
        """SIGTERM and SIGCONT to every descendant (a unit's: every process in its group); outside_group:
        only to those no longer in the leader's process group."""
        if self.unit:
            cgroups.signal_all(self.unit, signal.SIGTERM)
            cgroups.signal_all(self.unit, signal.SIGCONT)
            return
        me = os.getpid()
        told = me if outside_group else None
        linux.kill_tree(me, signal.SIGTERM, told_group=told)
        linux.kill_tree(me, signal.SIGCONT, told_group=told)

    def overdue(self) -> None:
        """The deadline has passed: SIGTERM after a stop signal's grace, else SIGKILL (again every 0.2 s)."""
        if self.term_pending:
            self.term_pending = False
            self.term_all()
            self.deadline = time.monotonic() + min(_TERM_STEP_SECONDS, self.stop_timeout)
        else:
            self.kill_all()

    def kill_all(self) -> None:
        """The stop timeout is over: SIGKILL everything (with a cgroup, the leader goes with it)."""
        self.killed = True
        if self.unit and self.unit_waits():
            self.unit_kills += 1
            cgroups.kill(self.unit)
            return  # its client reports the end, and exits
        if self.cgroup and cgroups.kill(self.cgroup):
            return
        linux.kill_until_gone(os.getpid())

    def unit_waits(self) -> bool:
        """Whether a unit's group still has processes to wait for (not after 5 s of SIGKILLs: a group that
        cannot be read counts as populated)."""
        return bool(self.unit) and cgroups.populated(str(self.unit)) and self.unit_kills < 25

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
                self.read_note()
                self.record_end(status)  # (first: the daemon may be stopped, or die before it reads)
                self.report(f"exit {status}")

    def record_end(self, status: int) -> None:
        """Write the command's end where the next daemon finds it (ends.py): only an end of its own, never
        one that followed the daemon's death (the leader, or systemd with the daemon's unit, stopped it
        then: that run goes back to the queue). A unit's end is what systemd-run said of its main process."""
        if not self.end_file or self.daemon_gone:
            return
        if self.unit:
            if DAEMON_GONE in signal.sigpending():
                return  # (systemd may have stopped the unit with the daemon's: not its own end)
            found = ends.of_unit(self.unit_said)
            if found is None:
                return
            code, sig = found
        else:
            code, sig = ends.of_status(status)
        with contextlib.suppress(OSError):
            ends.write(self.end_file, ends.End(code, sig, time.time()))

    def let_go(self) -> int:
        """The daemon died while its unit runs (not while stopping it): the unit outlives it, with its
        end recorded by systemd (ends.py). Arm the guard, end our client (the unit does not notice), go."""
        if self.main_status is None:
            if self.guard:
                unguarded.arm(self.guard)
            if self.child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.child.pid, signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return 0
            except InterruptedError:
                continue

    def read_note(self) -> None:
        """The last line the command wrote on its stderr before redirecting it, as an `error` line."""
        if self.note_fd is None:
            return
        try:
            data = os.read(self.note_fd, 4096)
        except OSError:
            data = b""
        os.close(self.note_fd)
        self.note_fd = None
        if self.unit:
            # systemd-run's own lines: passed on to the daemon as before (it reads the unit's end there)
            self.unit_said = data.decode("utf-8", "backslashreplace")
            with contextlib.suppress(OSError):
                os.write(2, data)
            return
        lines = [line for line in data.decode("utf-8", "backslashreplace").splitlines() if line.strip()]
        if lines:
            self.report(f"error {lines[-1]}")

    def run(self) -> int:
        """Wait for signals and children until nothing of the workload is left; return the exit code."""
        while True:
            have_children = self.reap()
            if self.main_status is not None and (self.deadline is None or self.term_pending):
                self.term_pending = False
                self.begin_stop()  # the command ended: its leftovers must not keep the GPU
            if not have_children and not self.unit_waits():
                break
            timeout: Optional[float] = None if have_children else 0.2
            if self.deadline is not None:
                timeout = min(timeout or 1e9, self.deadline - time.monotonic())
                if timeout <= 0:
                    step_was_term = self.term_pending
                    self.overdue()
                    timeout = max(0.0, self.deadline - time.monotonic()) if step_was_term else 0.2
            info = (
                signal.sigtimedwait(_SIGNALS, timeout)
                if timeout is not None
                else signal.sigwaitinfo(_SIGNALS)
            )
            if info is not None and info.si_signo == MAIN_STOP:
                self.signal_main()
            elif info is not None and info.si_signo == DAEMON_GONE and not self.daemon_gone:
                self.reap()  # a command that had ended already ended on its own: recorded as such
                self.daemon_gone = True
                if self.unit and self.deadline is None:
                    return self.let_go()
                self.begin_stop(daemon_alive=False)
            elif info is not None and info.si_signo != signal.SIGCHLD:
                # (the daemon's SIGTERM always goes to the whole group: supervisor.py's _killpg)
                from_daemon = info.si_signo == signal.SIGTERM and info.si_pid == self.daemon_pid
                self.begin_stop(daemon_alive=info.si_signo != DAEMON_GONE, group_told=from_daemon)
        return _exit_code(self.main_status)


def _exit_code(status: Optional[int]) -> int:
    if status is None:
        return 1
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _unblock_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS | _STRAY)


def main() -> int:
    """Entry point: read the spec from stdin, guard against the daemon dying, run the workload."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS | _STRAY)
    spec = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    linux.prctl(linux.PR_SET_PDEATHSIG, DAEMON_GONE)
    if os.getppid() != int(spec["daemon_pid"]):
        return 1  # the daemon died before we could ask to be told; there is nothing to run for
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    linux.set_name(b"gpu-mon-leader")
    leader = Leader(spec)
    failed = leader.start()
    if failed is not None:
        return failed
    return leader.run()


if __name__ == "__main__":
    sys.exit(main())
