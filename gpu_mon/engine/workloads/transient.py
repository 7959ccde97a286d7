"""Workloads as systemd transient service units: where systemd runs the machine, a queued job is started by
systemd itself (`systemd-run --wait`), so it runs outside gpu-mon's own sandbox and cgroup, as an ordinary
service of its user, in a unit of its own: `gpu-mon-job-17-r0.service` in `gpu_mon_jobs.slice`.

The `systemd-run` client runs under a leader like any workload (leader.py) and stays there until the unit
has ended: its exit is the workload's exit. The unit's processes are not our descendants, so a stop reaches
them through the unit's cgroup: each signal goes to every process listed in its `cgroup.procs` (through
pidfds, and only to those still in the group once their pidfd is held), the SIGKILL is its `cgroup.kill`;
where the group cannot be read, `systemctl kill` does it.

`systemd-run --wait` exits 0 for a unit whose main process SIGTERM ended (systemd counts that as a clean
exit) and 255 for one any other signal killed; the line it prints as the unit ends
(`Main processes terminated with: code=killed/status=TERM`) has the real status, and is what counts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from gpu_mon.api import procfs
from gpu_mon.engine.workloads import cgroups, ends

log = logging.getLogger("gpu_mon")

SLICE = "gpu_mon_jobs.slice"
SYSTEMD_DIR = "/run/systemd/system"  # exists where systemd is PID 1 (sd_booted)
LAUNCHERS = ("auto", "systemd", "direct")
# What systemd-run prints about the unit (info lines it writes on stderr, not the job's output, which goes
# to the job's file): swallowed, the end's status read.
_INFO = (
    "Running as unit: ",
    "Finished with result: ",
    "Main processes terminated with: ",
    "Service runtime: ",
    "CPU time consumed: ",
    "IP traffic received: ",
    "IP traffic sent: ",
    "IO bytes read: ",
    "IO bytes written: ",
)
_ENDED = re.compile(r"^Main processes terminated with: code=(\w+)/status=(\w+)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
CLIENT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_CANNOT_RUN = 126  # as the leader's: the command could not be started at all


class LauncherError(Exception):
    """`launcher = systemd` where systemd-run cannot be used; str() is one line."""


def systemd_runs(run_dir: str = SYSTEMD_DIR) -> bool:
    """Whether systemd runs this machine and its `systemd-run` is installed."""
    return os.path.isdir(run_dir) and shutil.which("systemd-run") is not None


def choose(launcher: str, root: bool, run_dir: str = SYSTEMD_DIR) -> bool:
    """Whether jobs run as transient units; LauncherError for `systemd` where that cannot be."""
    if launcher == "direct":
        return False
    usable = systemd_runs(run_dir)
    if launcher == "systemd" and not (usable and root):
        why = "gpu-mon is not running as root" if usable else "systemd does not run this machine"
        raise LauncherError(f"[queue] launcher = systemd, but {why}")
    return usable and root


_WAIT_CODE = (
    "import sys; sys.path.insert(0, {!r}); import gpu_mon.engine.workloads.unitwait as m; sys.exit(m.main())"
)
_PACKAGE_PARENT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)


def wait_command(end_file: str, group: str) -> List[str]:
    """The client of a unit found running after a restart (unitwait.py), in place of its systemd-run."""
    return [sys.executable, "-I", "-S", "-c", _WAIT_CODE.format(_PACKAGE_PARENT), end_file, group]


def client(argv: List[str]) -> subprocess.Popen:
    """A `systemd-run` or `systemctl` of ours, as root, in a group of its own, not waited for here.
    OSError if it cannot be started."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(CLIENT_ENV),
        cwd="/",
        start_new_session=True,
    )


def unit_name(job_id: int, restarts: int) -> str:
    """One run's unit: a new run never meets an old one still stopping."""
    return f"gpu-mon-job-{job_id}-r{restarts}.service"


def slice_path(name: str) -> str:
    """The cgroup path of a slice: `a-b.slice` is `a.slice/a-b.slice`."""
    stem = name[: -len(".slice")]
    parts = stem.split("-")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def unit_group(unit: str, proc: str = procfs.PROC) -> Optional[str]:
    """The directory of the unit's cgroup (v2, as systemd makes it), or None where it cannot be reached."""
    mount = cgroups.root_mount(proc)
    return os.path.join(mount, slice_path(SLICE), unit) if mount else None


def escape(arg: str) -> str:
    """systemd expands $NAME and ${NAME} in a unit's command line; `$$` is a plain `$`."""
    return arg.replace("$", "$$")


def environment(env: Dict[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """The variables systemd accepts for a unit, and the names of those it would refuse (a shell's exported
    functions, `BASH_FUNC_x%%`, or control characters in a value)."""
    kept, dropped = {}, []
    for name, value in env.items():
        bad = any((ord(c) < 32 and c not in "\t\n") or ord(c) == 127 for c in value) or not _utf8(value)
        if _ENV_NAME.match(name) and not bad:
            kept[name] = value
        else:
            dropped.append(name)
    return kept, dropped


def _utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # (a lone surrogate: bytes that were not UTF-8 in the submitter's env)
        return False
    return True


def _quoted(value: str) -> str:
    """The value in double quotes for systemd's environment-file parser: only a quote and a backslash are
    escaped (every systemd reads those two back; `$` and newlines are literal there)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_file(directory: str, unit: str, env: Dict[str, str]) -> str:
    """Write the unit's environment (from `environment`) to a root-only file that systemd reads as it
    starts the unit (EnvironmentFile=): on systemd-run's command line it would be anyone's to read with
    `ps` while the job runs, tokens and all. Each value double-quoted. Removed by `unit_ended`. OSError
    when it cannot be written."""
    return _root_file(directory, unit, ".env", "".join(f"{k}={_quoted(v)}\n" for k, v in env.items()))


# Run by systemd as root (`+`) at the unit's end, whether gpu-mon runs or not: the end of its main process,
# as systemd saw it, into the job's end record (ends.py), whole or absent. $1: the record's path.
_RECORD_END = 'umask 077; echo "unit $EXIT_CODE $EXIT_STATUS" >"$1.tmp" && mv -f "$1.tmp" "$1"'
# Run by systemd as root when the unit stops: only a stop of systemd's while the main process lives (a
# shutdown, `systemctl stop`, the guard) finds $MAINPID set; the mark says its end is not the job's own.
_MARK_STOP = '[ -z "$MAINPID" ] || { umask 077; : >"$1"; }'


def command(
    unit: str,
    description: str,
    argv: Tuple[str, ...],
    env_path: Optional[str],
    uid: int,
    gid: int,
    stop_signal: int,
    grace: float,
    end_file: Optional[str],
    main_only: bool = False,
    stderr: Optional[str] = None,
    runtime_max: Optional[float] = None,
    devices: Optional[Sequence[str]] = None,
) -> List[str]:
    """The `systemd-run` command line that runs `argv` as a transient service of its user, with the
    environment in `env_path` (`env_file`; never on the command line) (`end_file`: where the unit records
    its end itself, ends.py; `main_only`: its stop signal goes to its main process alone, SIGKILL to all,
    when systemd stops it; `stderr`: a file the unit's standard error goes to, made by `stderr_file`,
    instead of the journal; `runtime_max`: systemd ends it after that many seconds, and systemd-run says
    nothing but its exit status, as for a hook; `devices`: it may open only these devices, `device_allow`'s
    result). The unit is bound to nothing: it outlives gpu-mon."""
    out = ["systemd-run", "--wait", f"--unit={unit}", f"--uid={uid}", f"--gid={gid}"]
    if runtime_max is not None:
        out += ["--quiet", "-p", f"RuntimeMaxSec={runtime_max:g}"]
    if stderr:
        out += ["-p", f"StandardError=file:{stderr}"]  # (made empty: file: is append:, and systemd 236's)
    out += ["--service-type=exec", "--collect", f"--slice={SLICE}", "--working-directory=/"]
    out += [f"--description={description}"]
    # When systemd stops it (a shutdown, the guard while gpu-mon is away): its stop signal and grace.
    mode = "mixed" if main_only else "control-group"  # (mixed: the stop signal to the main process alone)
    out += ["-p", f"KillMode={mode}", "-p", f"KillSignal={int(stop_signal)}"]
    out += ["-p", f"TimeoutStopSec={max(1, int(grace + 1.999))}", "-p", "SendSIGKILL=yes"]
    if end_file:
        if not _PLAIN_PATH.match(end_file):
            raise OSError(errno.EINVAL, "not a plain path (letters, digits, /._-)", end_file)
        mark = ends.stop_mark(end_file)
        out += ["-p", f"ExecStop=+/bin/sh -c {_sh(_MARK_STOP)} gpu-mon-stopped {mark}"]
        out += ["-p", f"ExecStopPost=+/bin/sh -c {_sh(_RECORD_END)} gpu-mon-end {end_file}"]
    if devices is not None:  # (`device_allow`: the only devices it may open besides the pseudo devices)
        out += ["-p", "DevicePolicy=closed"]
        out += [x for d in devices for x in ("-p", f"DeviceAllow={d} rw")]
    if env_path:
        # "-": systemd reads it for each of the unit's commands, its ExecStop= and ExecStopPost= too, by
        # when it may be gone (with /run/gpu_mon, which systemd removes as gpu-mon's unit stops)
        out += ["-p", f"EnvironmentFile=-{env_path}"]
    out += ["--", *[escape(a) for a in argv]]
    return out


# The driver's nodes every CUDA program opens, shared by all GPUs: nvidiactl and nvidia-modeset (the last
# two minors of the GPUs' own major, fixed by the driver), and the classes of nvidia-uvm (CUDA's memory
# manager), nvidia-caps (MIG) and the IMEX channels (a class the running driver does not register is
# skipped by systemd).
NVIDIA_MAJOR = 195
SHARED_NODES = (f"/dev/char/{NVIDIA_MAJOR}:255", f"/dev/char/{NVIDIA_MAJOR}:254")
SHARED_CLASSES = ("char-nvidia-uvm", "char-nvidia-caps", "char-nvidia-caps-imex-channels")


def device_allow(nodes: Sequence[str], extra: Sequence[str]) -> List[str]:
    """What a confined job may open (systemd's DeviceAllow=, named by numbers: systemd takes
    /dev/char/MAJOR:MINOR without looking at the disk, and would refuse a path outside /dev): its GPUs'
    nodes (the character devices at `nodes`; a node that is not one, a simulator's file, needs nothing),
    the driver's shared nodes, and the admin's `extra`. Every other GPU's node is refused (EPERM)."""
    own = []
    for path in nodes:
        try:
            st = os.stat(path)
        except OSError:
            continue  # (a GPU without its node counts as busy: never a job's)
        if stat.S_ISCHR(st.st_mode):
            own.append(f"/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    return [*dict.fromkeys(own), *SHARED_NODES, *SHARED_CLASSES, *extra]


def _sh(script: str) -> str:
    """A script as one word of a unit's command line: single-quoted (it has no quote of that kind), its
    `$` doubled (systemd would expand them itself)."""
    assert "'" not in script and "\\" not in script
    return "'" + escape(script) + "'"


_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9/._-]+$")
_STDERR_TAIL = 4096  # bytes of a unit's standard error read back (a few lines are all a wrapper says)


def _root_file(directory: str, unit: str, suffix: str, text: str = "") -> str:
    """Write `text` to the unit's root-only (0600) file DIRECTORY/UNIT.SUFFIX, a value of a unit
    property (so a plain path: no blanks, no systemd specifiers); its path. OSError if it cannot be.
    Always a new file: one left there (a run before a crash, or, where state_file's directory is a sticky
    one like /tmp, another user's, who could read a job's tokens in it or add to its environment) is
    removed first, and a file that is there again by the open is refused (O_EXCL)."""
    path = os.path.join(directory, f"{unit}{suffix}")
    if not _PLAIN_PATH.match(path):
        raise OSError(errno.EINVAL, "not a plain path (letters, digits, /._-)", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def stderr_file(directory: str, unit: str) -> Optional[str]:
    """Make the (empty, root's, 0600) file that a job's unit appends its standard error to until its
    wrapper has opened the job's output: what a failed start says (`cannot open /x/3.log: Permission
    denied`), which a unit would otherwise leave in the journal. None where it cannot be made."""
    try:
        return _root_file(directory, unit, ".err")
    except OSError as err:
        log.debug("queue: %s: no file for its standard error: %s", unit, err.strerror)
        return None


def unit_ended(directory: str, unit: str) -> str:
    """The last line the unit wrote to its `stderr_file` ("" when none); its files removed."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, f"{unit}.env"))
    path = os.path.join(directory, f"{unit}.err")
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _STDERR_TAIL))
            tail = f.read(_STDERR_TAIL)
        os.unlink(path)
    except OSError:
        return ""
    lines = [line for line in tail.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Unit:
    """One running job's unit, as its workload's stop and end see it."""

    def __init__(self, name: str, group: Optional[str]) -> None:
        self.name = name
        self.group = group
        self.status: Optional[int] = None  # the main process's end, as systemd-run reported it
        self.killed_by = 0  # the signal that ended it, as systemd-run reported it (0: it exited)
        self.helper: Optional[subprocess.Popen] = None  # the last `systemctl kill`

    def pids(self) -> List[int]:
        """The processes in the unit now (empty when it has none, or cannot be read)."""
        return cgroups.procs(self.group) if self.group else []

    def signal(self, sig: int) -> bool:
        """Send `sig` to every process in the unit; False when the group could not be read (nothing was
        sent), so that `systemctl kill` is tried instead."""
        if self.group and os.path.isdir(self.group):
            cgroups.signal_all(self.group, sig)
            return True
        return False

    def kill(self) -> bool:
        """SIGKILL every process in the unit; False when its group could not be reached."""
        return bool(self.group) and os.path.isdir(str(self.group)) and cgroups.kill(str(self.group))

    def populated(self) -> bool:
        """Whether any process of the unit is left (False once its group is gone)."""
        return bool(self.group) and cgroups.populated(str(self.group))

    def systemctl_kill(self, sig: int, whom: str = "all") -> Optional[subprocess.Popen]:
        """The slow way (a process spawned, not waited for here): where the unit's group cannot be read;
        and the way to signal its main process alone (`whom="main"`)."""
        if self.helper is not None and self.helper.poll() is None:
            return None  # the last one is still at it
        try:
            self.helper = subprocess.Popen(
                ["systemctl", "kill", f"--signal={int(sig)}", f"--kill-whom={whom}", self.name],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            return None
        return self.helper

    def done(self) -> None:
        """Reap the last `systemctl kill`, if it has ended."""
        if self.helper is not None:
            self.helper.poll()

    def note(self, line: str) -> bool:
        """A line of systemd-run's output: True when it is systemd-run's own (not to be relayed)."""
        m = _ENDED.match(line)
        if m:
            self.status = _status(m.group(1), m.group(2))
            self.killed_by = self.status - 128 if m.group(1) != "exited" and self.status > 128 else 0
        return line.startswith(_INFO)

    def returncode(self, client: int) -> int:
        """The job's exit status: its main process's, as systemd-run reported it; when it reported none,
        the unit never ran (126), or the client ended as it did."""
        if self.status is not None:
            return self.status
        return _CANNOT_RUN if client != 0 else 0


def _status(code: str, value: str) -> int:
    if code == "exited" and value.isdigit():
        return int(value)
    name = value if value.startswith("SIG") else f"SIG{value}"
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return 128 + int(value) if value.isdigit() else 1
