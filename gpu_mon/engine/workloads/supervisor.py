"""Workload processes: spawn (through a leader, see leader.py), contain (a cgroup, or the subreaper), stop
(TERM, then KILL), reap, relay output. Everything here is driven by the daemon's event loop; nothing blocks
for long.

Signals: the leader is our direct child and we reap it only after it has exited, so its pid (= the
workload's process group id) cannot be reused while we may still signal the group: `killpg(leader_pid)` is
as safe as a pidfd. Single processes (the leader, orphans, a leader's descendants) are signalled through
pidfds, each only while its start time is the one read in the look that found it a descendant: the leader
reaps its own children while we kill them, and a pid it reaped may be any process's by then (linux.py).

Containment is by descent, not by group: with a cgroup (cgroups.py) the SIGKILL step is `cgroup.kill`,
which reaches every process the workload ever forked; without one, every descendant of the leader (the
leader and the daemon are child subreapers, so escaped processes stay descendants) is killed until none is
left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pwd
import selectors
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from gpu_mon import safefile
from gpu_mon.api import procfs
from gpu_mon.api.model import Exited, Running
from gpu_mon.api.text import sanitize
from gpu_mon.config import ProcessSection
from gpu_mon.engine.workloads import cgroups, linux, transient
from gpu_mon.engine.workloads.leader import MAIN_STOP
from gpu_mon.engine.workloads.stopping import StopRule, signal_name
from gpu_mon.engine.workloads.transient import Unit
from gpu_mon.policy.decisions import Instance

log = logging.getLogger("gpu_mon")

_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
_LEADER_CODE = (
    "import sys; sys.path.insert(0, {!r}); import gpu_mon.engine.workloads.leader as m; sys.exit(m.main())"
)
_MAX_LINE = 4096
_READ_BUDGET = 65536  # bytes of workload output relayed per wake, so a chatty workload cannot stall the loop
_ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_USER_PATH = "/usr/local/bin:/usr/bin:/bin"


class StartError(Exception):
    """A workload could not be started; str() is one line."""


@dataclass(frozen=True)
class Launch:
    """One command to run under a leader: what, where, as whom, and where its output goes."""

    argv: Tuple[str, ...]
    dir: str
    env: Dict[str, str]
    uid: int
    gid: int
    groups: Tuple[int, ...] = ()
    switch_user: bool = False
    log: Optional[str] = None  # append its output here; None: relay it to our log, tagged
    # (stdin, stdout, stderr) fds it inherits instead (`gpu-mon watch`: the terminal's); None: as above
    stdio: Optional[Tuple[int, int, int]] = None
    # argv is `systemd-run --wait` starting this unit (transient.py): stops go to the unit's processes
    unit: Optional[Unit] = None
    # the last line the command writes on stderr before redirecting it is why it ended (leader.py)
    note_stderr: bool = False
    # a queue job's: where the leader records the command's end before it says so (ends.py)
    end_file: Optional[str] = None
    # a unit's: how long it may run on once the daemon is gone (unguarded.py; None: no guard)
    guard_seconds: Optional[float] = None


def unit_launch(argv: List[str], unit: Unit, end_file: str, guard_seconds: float) -> Launch:
    """A client of a job's transient unit (its systemd-run, or unitwait.py's after a restart), as root."""
    return Launch(
        argv=tuple(argv),
        dir="/",
        env=transient.CLIENT_ENV,
        uid=0,
        gid=0,
        unit=unit,
        end_file=end_file,
        guard_seconds=guard_seconds,
    )


@dataclass
class Workload:
    """One running instance: its leader process and what we know of it."""

    instance: Instance
    label: str
    popen: subprocess.Popen
    pidfd: Optional[int]
    status_fd: Optional[int]
    out_fd: Optional[int]
    started_at: float
    command_pid: Optional[int] = None
    cgroup: Optional[str] = None
    stopping: bool = False
    stop_reason: str = ""
    rule: StopRule = dataclasses.field(default_factory=StopRule)
    urgent: bool = False  # the stop has the urgent grace (a foreign process opened the GPU)
    steps: List[Tuple[int, float]] = dataclasses.field(default_factory=list)  # (signal, wait) still to come
    sent: List[int] = dataclasses.field(default_factory=list)  # the signals of the stop sent so far
    stop_sent_at: Optional[float] = None
    step_at: Optional[float] = None
    kill_at: Optional[float] = None
    killed: bool = False
    exit_status: Optional[int] = None  # the command's wait status, as the leader reported it
    detail: str = ""
    out_buf: bytes = b""
    status_buf: bytes = b""
    unit: Optional[Unit] = None  # a transient unit runs the command (transient.py)
    unit_pending: Optional[int] = None  # a signal for the unit, whose group does not exist yet

    @property
    def pid(self) -> int:
        """The leader's pid: also the workload's session and process group id."""
        return self.popen.pid


def workload_env(section: ProcessSection, uuids: Tuple[str, ...]) -> Dict[str, str]:
    """A clean environment: the target user's basics, `env =`, and the GPUs by UUID. Nothing of ours."""
    try:
        shell = pwd.getpwuid(section.uid).pw_shell or "/bin/sh"
    except KeyError:
        shell = "/bin/sh"
    env = {
        "PATH": _ROOT_PATH if section.uid == 0 else _USER_PATH,
        "HOME": section.home,
        "USER": section.user,
        "LOGNAME": section.user,
        "SHELL": shell,
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "GPU_MON_PROCESS": section.name,
    }
    env.update(dict(section.env))
    env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


class Supervisor:
    """Owns every workload the daemon started."""

    def __init__(
        self,
        selector: selectors.BaseSelector,
        rule: StopRule,
        cgroup_tree: Optional[cgroups.CgroupTree] = None,
    ):
        self.selector = selector
        self.rule = rule  # for workloads started without one of their own
        self.cgroup_tree = cgroup_tree
        self.workloads: Dict[str, Workload] = {}
        self.exits: List[Exited] = []
        self.draining: List[str] = []  # cgroups of ended workloads that still have processes in them
        self.sweeping = False  # orphans of a killed leader outlasted a sweep: sweep again at each tick
        self.own_pid = os.getpid()
        self.helpers: Dict[int, subprocess.Popen] = {}  # our own short jobs (the sentinel's action)

    def contain_in(self, tree: Optional[cgroups.CgroupTree]) -> None:
        """Give each workload started from now on a cgroup under `tree` (None: the subreaper only)."""
        self.cgroup_tree = tree

    def set_rule(self, key: str, rule: StopRule) -> None:
        """How this workload's next stop goes (a reload changed its section's stop settings)."""
        w = self.workloads.get(key)
        if w is not None and not w.stopping:  # (a stop under way keeps its steps)
            w.rule = rule

    def failed_to_start(self, key: str, now: float, detail: str) -> None:
        """Record a start that failed before any process ran, as an exit (so that it backs off)."""
        self.exits.append(Exited(key, now, now, 126, False, detail=detail))

    def kill_all_now(self, now: float) -> None:
        """Escalate every stop under way to SIGKILL at the next tick."""
        for w in self.workloads.values():
            if w.stopping:
                w.kill_at, w.steps = now, []

    # ------------------------------------------------------------------ starting

    def start(
        self, instance: Instance, section: ProcessSection, label: str, now: float, rule: StopRule
    ) -> Workload:
        """Spawn the instance's leader; raise StartError with one line if that is impossible."""
        switch_user = os.geteuid() == 0
        section = _runnable(section, switch_user)
        launch = Launch(
            argv=tuple(section.cmd),
            dir=section.dir,
            env=workload_env(section, instance.gpus),
            uid=section.uid,
            gid=section.gid,
            groups=tuple(section.groups),
            switch_user=switch_user,
            log=section.log,
        )
        return self.launch(instance, launch, label, now, rule)

    def launch(
        self, instance: Instance, launch: Launch, label: str, now: float, rule: Optional[StopRule] = None
    ) -> Workload:
        """Spawn a leader that runs `launch`, contained like every workload; StartError if impossible."""
        rule = rule or self.rule
        if launch.stdio is None:
            out_fd, write_fd = _output(launch.log)
            stdio = (write_fd, write_fd, write_fd)
        else:
            out_fd, write_fd, stdio = None, None, launch.stdio
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(status_r, False)
        try:
            passed = (status_w,) if launch.stdio is None else (status_w, stdio[0])
            popen = spawn_leader(label, stdio[1], stdio[2], passed)
        except OSError as err:
            for fd in (out_fd, status_r):
                if fd is not None:
                    os.close(fd)
            raise StartError(f"cannot start the leader process: {err}") from None
        finally:
            for fd in (write_fd, status_w):
                if fd is not None:
                    os.close(fd)
        spec = {
            "argv": list(launch.argv),
            "dir": launch.dir,
            "env": launch.env,
            "uid": launch.uid,
            "gid": launch.gid,
            "groups": list(launch.groups),
            "switch_user": launch.switch_user,
            "status_fd": status_w,
            "stdin_fd": stdio[0] if launch.stdio is not None else None,
            "daemon_pid": self.own_pid,
            "stop_signal": rule.signal,
            "stop_main_only": rule.main_only,
            "note_stderr": launch.note_stderr,
            "end_file": launch.end_file,
            "stop_timeout_seconds": rule.grace,
            # The leader waits for its spec before it starts anything: move it into its cgroup first.
            "cgroup": self._contain(popen.pid, label),
            "unit_cgroup": launch.unit.group if launch.unit is not None else None,
            "unit_guard_seconds": launch.guard_seconds if launch.unit is not None else None,
        }
        send_spec(popen, spec)
        w = Workload(
            instance=instance,
            label=label,
            popen=popen,
            pidfd=os.pidfd_open(popen.pid),
            status_fd=status_r,
            out_fd=out_fd,
            started_at=now,
            cgroup=spec["cgroup"],
            rule=rule,
            unit=launch.unit,
        )
        self._register(w)
        return w

    def _register(self, w: Workload) -> None:
        key = w.instance.key
        self.workloads[key] = w
        assert w.pidfd is not None and w.status_fd is not None
        self.selector.register(w.pidfd, selectors.EVENT_READ, ("exit", key))
        self.selector.register(w.status_fd, selectors.EVENT_READ, ("status", key))
        if w.out_fd is not None:
            self.selector.register(w.out_fd, selectors.EVENT_READ, ("output", key))

    def _contain(self, leader_pid: int, label: str) -> Optional[str]:
        if self.cgroup_tree is None:
            return None
        try:
            return self.cgroup_tree.create(leader_pid)
        except OSError as err:
            log.warning("%s: cannot create its cgroup (%s): containing it by descent only", label, err)
            return None

    # ------------------------------------------------------------------ stopping

    def stop(self, key: str, reason: str, now: float, urgent: bool = False) -> None:
        """The workload's stop signal to its main process group now; the next step (SIGTERM, SIGKILL) when
        its grace is over (see `tick`, stopping.py). A stop under way that becomes urgent is hurried."""
        w = self.workloads.get(key)
        if w is None:
            return
        if w.stopping:
            if urgent:
                self.hurry(w)
            return
        w.stopping, w.stop_reason, w.urgent = True, reason, urgent
        w.stop_sent_at = now
        w.steps = list(w.rule.steps(urgent))
        self._next_step(w, now)

    def hurry(self, w: Workload) -> None:
        """The rest of a stop under way gets the urgent graces (counted from when each step began)."""
        if w.urgent or w.killed or w.step_at is None or w.kill_at is None:
            return
        w.urgent = True
        urgent = w.rule.steps(True)
        at = len(w.sent) - 1
        if at >= len(urgent):
            return
        w.kill_at = min(w.kill_at, w.step_at + urgent[at][1])
        w.steps = list(urgent[at + 1 :])

    def _next_step(self, w: Workload, now: float) -> None:
        sig, wait = w.steps.pop(0)
        first = not w.sent
        w.sent.append(sig)
        w.step_at, w.kill_at = now, now + wait
        if first and w.rule.main_only:
            self._signal_main(w, sig)
            return
        if w.unit is not None:
            self._signal_unit(w, sig)
            return
        _killpg(w.pid, sig)
        _killpg(w.pid, signal.SIGCONT)  # a stopped process sees its signal only once it runs

    def _signal_main(self, w: Workload, sig: int) -> None:
        """The stop signal to the main process alone: told to the leader (MAIN_STOP), which reaps it and
        so alone may signal it by pid; a unit's main process through `systemctl kill --kill-whom=main`."""
        if w.unit is not None:
            helper = w.unit.systemctl_kill(sig, whom="main")
            if helper is not None:
                self.helpers[helper.pid] = helper
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, MAIN_STOP)  # (our unreaped child: its pid is still the leader's)

    def _signal_unit(self, w: Workload, sig: int) -> None:
        """A step of a transient unit's stop: to every process in the unit (never to its systemd-run
        client, whose exit reports the unit's end). Until systemd has made the unit's group, again at each
        tick; where no group can be read, through `systemctl kill`."""
        assert w.unit is not None
        w.unit_pending = None
        if w.unit.signal(sig):
            w.unit.signal(signal.SIGCONT)
        elif w.unit.group is not None:
            w.unit_pending = sig
        else:
            helper = w.unit.systemctl_kill(sig)
            if helper is not None:
                self.helpers[helper.pid] = helper

    def let_go(self, key: str) -> bool:
        """gpu-mon stops and leaves this workload's transient unit running (it outlives us): forget it
        without a signal. Its leader, told by the kernel as we exit, arms the guard and ends its client
        (leader.py); until then it is kept from sweeps like a helper. False for one that is no unit's, or
        already stopping (a stop under way is finished)."""
        w = self.workloads.get(key)
        if w is None or w.unit is None or w.stopping:
            return False
        del self.workloads[key]
        self.on_output(w, final=True)
        for name in ("pidfd", "status_fd", "out_fd"):
            self._close_fd(w, name)
        self.helpers[w.pid] = w.popen
        return True

    def stop_all(self, reason: str, now: float) -> None:
        """Stop every workload."""
        for key in list(self.workloads):
            self.stop(key, reason, now)

    def next_kill(self) -> Optional[float]:
        """When `tick` next has something to escalate (monotonic), or None."""
        return min((w.kill_at for w in self.workloads.values() if w.kill_at is not None), default=None)

    def tick(self, now: float) -> None:
        """Escalate overdue stops to SIGKILL (and again each second until the leader is gone)."""
        for w in self.workloads.values():
            if w.unit_pending is not None and not w.killed:
                self._signal_unit(w, w.unit_pending)
            if w.kill_at is None or now < w.kill_at:
                continue
            if w.steps and not w.killed:
                self._next_step(w, now)
                continue
            if w.unit is not None and self._kill_unit(w, now):
                continue
            if not w.killed:
                log.warning(
                    "%s[%d] still running %.1f s after %s; killing every process it started (%s)",
                    w.label,
                    w.pid,
                    now - (w.step_at or now),
                    signal_name(w.sent[-1]) if w.sent else "SIGTERM",
                    "cgroup.kill" if w.cgroup else "SIGKILL to each descendant",
                )
            elif not w.cgroup:
                _killpg(w.pid, signal.SIGKILL)  # a second round: the leader itself has not finished
            w.killed = True
            if not (w.cgroup and cgroups.kill(w.cgroup)):
                linux.kill_until_gone(w.pid)
            w.kill_at = now + 1.0
        self.drain()
        if self.sweeping:
            self.sweep_orphans()

    def _kill_unit(self, w: Workload, now: float) -> bool:
        """The SIGKILL step of a transient unit: its group's cgroup.kill (its systemd-run client then
        reports the end). False when the unit is gone, or has outlasted it for 5 s: then the client too."""
        assert w.unit is not None
        if not (w.unit.group is None or w.unit.populated()) or now > (w.step_at or now) + w.rule.grace + 5:
            return False
        if not w.killed:
            log.warning(
                "%s[%d] still running %.1f s after %s; killing every process of %s",
                w.label,
                w.pid,
                now - (w.step_at or now),
                signal_name(w.sent[-1]) if w.sent else "SIGTERM",
                w.unit.name,
            )
        w.killed, w.unit_pending = True, None
        if not w.unit.kill():
            helper = w.unit.systemctl_kill(signal.SIGKILL)
            if helper is not None:
                self.helpers[helper.pid] = helper
        w.kill_at = now + 1.0
        return True

    def drain(self) -> None:
        """Kill and remove the cgroups of ended workloads until they are empty."""
        for path in list(self.draining):
            if not cgroups.populated(path) and cgroups.remove(path):
                self.draining.remove(path)
            else:
                cgroups.kill(path)

    def busy(self) -> bool:
        """Whether any workload, or anything left of one, still runs."""
        return bool(self.workloads or self.draining or self.sweeping)

    def next_deadline(self, now: float) -> Optional[float]:
        """When `tick` next has something to do (monotonic), or None."""
        kill = self.next_kill()
        if any(w.unit_pending is not None for w in self.workloads.values()):
            kill = min(kill, now + 0.05) if kill is not None else now + 0.05
        if self.draining or self.sweeping:
            kill = min(kill, now + 0.05) if kill is not None else now + 0.05
        return kill

    # ------------------------------------------------------------------ events

    def on_exit(self, key: str, now: float) -> Optional[Exited]:
        """The leader's pidfd is readable: it exited. Take its group down (belt and braces) and reap it."""
        w = self.workloads.pop(key, None)
        if w is None:
            return None
        self.on_status(w)
        _killpg(w.pid, signal.SIGKILL)  # a leader killed by SIGKILL leaves its group behind
        code = w.popen.wait()
        self._end_containment(w, code)
        self.on_output(w, final=True)
        for name in ("pidfd", "status_fd", "out_fd"):
            self._close_fd(w, name)
        returncode = 128 - code if code < 0 else code
        if code == -signal.SIGKILL and w.exit_status is not None:
            returncode = _status_code(w.exit_status)  # cgroup.kill took the leader after the command ended
        if w.unit is not None:
            returncode = self._unit_ended(w, returncode)
        if w.stopping and w.stop_sent_at is not None:
            log.info("%s[%d] stopped %s", w.label, w.pid, _how_stopped(w, now - w.stop_sent_at))
        ex = Exited(
            key=key,
            started_at=w.started_at,
            ended_at=now,
            returncode=returncode,
            stopped_by_us=w.stopping,
            detail=w.detail,
            signal=_killed_by(w, code),
        )
        self.exits.append(ex)
        return ex

    @staticmethod
    def _unit_ended(w: Workload, client: int) -> int:
        """Nothing of a transient unit outlives its client (which ended with the unit, unless it was killed);
        the job's own exit status."""
        assert w.unit is not None
        if w.unit.populated():
            w.unit.kill()
        w.unit.done()
        return w.unit.returncode(client)

    def _end_containment(self, w: Workload, code: int) -> None:
        """Whatever the leader left behind (it was killed, or escaped processes raced it) dies now."""
        if w.cgroup:
            cgroups.kill(w.cgroup)
            self.draining.append(w.cgroup)
            self.drain()
        elif code < 0:
            self.sweep_orphans()

    def on_status(self, w: Workload) -> None:
        """Read the leader's status lines (`started PID`, `error ...`)."""
        if w.status_fd is None:
            return
        data, eof = _read_some(w.status_fd, 4096)
        w.status_buf += data
        if eof:
            self._close_fd(w, "status_fd")
        while b"\n" in w.status_buf:
            line, w.status_buf = w.status_buf.split(b"\n", 1)
            text = line.decode("utf-8", "backslashreplace")
            kind, _, rest = text.partition(" ")
            if kind == "started" and rest.isdigit():
                w.command_pid = int(rest)
            elif kind == "exit" and rest.isdigit():
                w.exit_status = int(rest)
            elif kind == "error":
                w.detail = sanitize(rest)
                log.error("%s: %s", w.label, w.detail)

    def on_output(self, w: Workload, final: bool = False) -> None:
        """Relay the workload's output to our log, one tagged, sanitized line per line."""
        if w.out_fd is None:
            return
        data, eof = _read_some(w.out_fd, _READ_BUDGET)
        w.out_buf += data
        if eof:
            final = True
            self._close_fd(w, "out_fd")
        lines = w.out_buf.split(b"\n")
        w.out_buf = lines.pop()
        if len(w.out_buf) > _MAX_LINE or (final and w.out_buf):
            lines.append(w.out_buf)
            w.out_buf = b""
        pid = w.pid  # the workload's session and process group id, as in every other log line about it
        for raw in lines:
            text = raw.decode("utf-8", "backslashreplace").rstrip("\r")
            if w.unit is not None and w.unit.note(text):
                continue
            log.info("%s[%d]: %s", w.label, pid, sanitize(text, limit=_MAX_LINE))

    def _close_fd(self, w: Workload, name: str) -> None:
        fd = getattr(w, name)
        if fd is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)
        os.close(fd)
        setattr(w, name, None)

    def dispatch(self, kind: str, key: str, now: float) -> Optional[Exited]:
        """Handle a ready fd registered by this supervisor."""
        w = self.workloads.get(key)
        if w is None:
            return None
        if kind == "exit":
            return self.on_exit(key, now)
        if kind == "status":
            self.on_status(w)
        elif kind == "output":
            self.on_output(w)
        return None

    def spawn_helper(self, argv: List[str], env: Dict[str, str]) -> subprocess.Popen:
        """Start one of gpu-mon's own commands (not a workload): never reaped or swept as an orphan here,
        so whoever waits for it gets its status. Call from the loop's thread. OSError if it cannot run."""
        self.helpers = {pid: p for pid, p in self.helpers.items() if p.returncode is None}
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd="/"
        )
        self.helpers[popen.pid] = popen
        return popen

    def sweep_orphans(self) -> None:
        """Kill and reap our descendants that no live leader owns: remnants of a killed leader.

        We are a child subreaper (daemon.py), so they were reparented to us; only our own descendants can be.
        What one sweep's budget does not finish (a fork chain on a loaded machine) is swept again at every
        tick until nothing is left.
        """
        leaders = {w.pid for w in self.workloads.values()} | set(self.helpers)
        self.sweeping = not linux.kill_until_gone(self.own_pid, skip=leaders)
        self.reap_orphans()

    def reap_orphans(self) -> None:
        """Reap exited children that are not leaders (never a leader: those are reaped in on_exit)."""
        leaders = {w.pid for w in self.workloads.values()} | set(self.helpers)
        for pid in procfs.children(self.own_pid):
            if pid in leaders:
                continue
            st = procfs.read_stat(pid)
            if st is not None and st.state == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    # ------------------------------------------------------------------ views

    def running(self) -> Tuple[Running, ...]:
        """What the policy needs to know about live workloads."""
        return tuple(
            Running(key=k, pid=w.pid, started_at=w.started_at, stopping=w.stopping)
            for k, w in self.workloads.items()
        )

    def views(self) -> List[dict]:
        """What outputs show of each live workload (plain data)."""
        return [
            {
                "key": k,
                "label": w.label,
                "gpus": list(w.instance.gpus),
                "pid": w.pid,
                "command_pid": w.command_pid,
                "started_at": w.started_at,
                "stopping": w.stopping,
                "stop_reason": w.stop_reason,
            }
            for k, w in self.workloads.items()
        ]

    def take_exits(self) -> Tuple[Exited, ...]:
        """Exits since the last call."""
        out, self.exits = tuple(self.exits), []
        return out

    def sessions(self) -> Dict[int, Tuple[str, ...]]:
        """Session ids of our workloads (= leader pids), and the processes in the transient units that run
        jobs (not in a leader's session, nor its descendants) -> the GPUs (UUIDs) that workload was given:
        a process of it is ours on those GPUs only (observe.py)."""
        out = {w.pid: w.instance.gpus for w in self.workloads.values()}
        for w in self.workloads.values():
            if w.unit is not None:
                out.update((pid, w.instance.gpus) for pid in w.unit.pids())
        return out


def _runnable(section: ProcessSection, switch_user: bool) -> ProcessSection:
    """The section as it can run: as its user when we are root, else as us (unless a user was written)."""
    if switch_user or section.uid == os.geteuid():
        return section
    if section.user_explicit:
        raise StartError(f"cannot run as {section.user}: gpu-mon is not running as root")
    return _as_current_user(section)


def _output(log_path: Optional[str]) -> Tuple[Optional[int], int]:
    """(fd we read the workload's output from, or None when it goes to its log file; fd it writes to)."""
    if log_path:
        try:
            return None, safefile.open_append(log_path)
        except safefile.UnsafeFile as err:
            raise StartError(f"log file {err}") from None
    out_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(out_fd, False)
    return out_fd, write_fd


def spawn_leader(label: str, stdout: int, stderr: int, pass_fds: Tuple[int, ...]) -> subprocess.Popen:
    """The leader process, in its own session, with nothing of ours but the fds it needs."""
    # argv[0] is the interpreter's real path, the label a trailing argument (for `ps`): Python finds its
    # standard library from argv[0], and with a bare name and the working directory / (systemd's) a
    # pyenv or venv Python found /lib/python3.X, another build's, and the leader died at import. -S: no
    # site (the leader needs nothing from site-packages but our package, whose parent it puts on its path;
    # a virtualenv's site and an editable install's import hook were half its start).
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _LEADER_CODE.format(_PACKAGE_PARENT), f"gpu-mon-leader[{label}]"],
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        pass_fds=pass_fds,
        start_new_session=True,
        close_fds=True,
        env={"PATH": _ROOT_PATH, "LANG": "C.UTF-8"},
    )


def send_spec(popen: subprocess.Popen, spec: dict) -> None:
    try:
        assert popen.stdin is not None
        popen.stdin.write(json.dumps(spec).encode("utf-8"))
        popen.stdin.close()
    except OSError:
        pass  # it died at once; its exit is reported through the pidfd like any other


def _as_current_user(section: ProcessSection) -> ProcessSection:
    pw = pwd.getpwuid(os.geteuid())
    return dataclasses.replace(
        section,
        user=pw.pw_name,
        uid=pw.pw_uid,
        gid=os.getegid(),
        home=pw.pw_dir,
        groups=tuple(os.getgroups()),
    )


def _how_stopped(w: Workload, took: float) -> str:
    """`in 84 ms (SIGTERM)`, `in 2300 ms (SIGTERM after SIGUSR1)`, `by SIGKILL after 10.0 s`: the step that
    ended it."""
    names = [signal_name(s) for s in w.sent]
    if w.killed:
        first = f" ({', '.join(names)} first)" if names and names != ["SIGTERM"] else ""
        return f"by SIGKILL after {took:.1f} s{first}"
    last = names[-1] if names else "SIGTERM"
    earlier = f" after {', '.join(names[:-1])}" if len(names) > 1 else ""
    return f"in {took * 1000:.0f} ms ({last}{earlier})"


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _read_some(fd: int, budget: int) -> Tuple[bytes, bool]:
    """Read what is there (up to `budget`) from a non-blocking fd; also say whether it reached EOF."""
    chunks = []
    eof = False
    while budget > 0:
        try:
            chunk = os.read(fd, min(budget, 65536))
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            eof = True
            break
        if not chunk:
            eof = True
            break
        chunks.append(chunk)
        budget -= len(chunk)
    return b"".join(chunks), eof


def _killed_by(w: Workload, code: int) -> int:
    """The signal that ended the command (0: it exited): as systemd-run or the leader (its `exit` line)
    reported it, else the leader's own end. Tells a command killed by SIGTERM from one that exited 143."""
    if w.unit is not None:
        return w.unit.killed_by
    if w.exit_status is not None:
        return os.WTERMSIG(w.exit_status) if os.WIFSIGNALED(w.exit_status) else 0
    return -code if code < 0 else 0


def _status_code(status: int) -> int:
    """A wait status as an exit code (128 + signal when killed)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
