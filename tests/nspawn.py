"""A real systemd for the tests: `systemd-nspawn --volatile=yes` boots one as PID 1 of a container over this
machine's own root, and `nsenter` runs systemctl and journalctl inside it.

With `--volatile=yes` the container's root is a tmpfs with the host's `/usr` mounted read-only: its `/etc`,
`/var`, `/run` and `/tmp` are its own and vanish with it, so nothing it writes there reaches the host. The
directories a test needs (the checkout, the Python installation, a scratch directory) are bind-mounted.
Where the host has cgroup v2 (alone, or beside v1), the container's systemd gets v2 alone, like a current
server's.
The container runs in a cgroup of its own, made for it and removed afterwards; `stop()` ends it and
everything in it, and says what it could not clean up.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import psutil

BOOT_TIMEOUT = 60.0
# Left on the host by systemd-nspawn itself; removed after the container if they were not there before.
_SERIAL = itertools.count(1)  # containers booted by this process: each gets a name of its own
NSPAWN_RUN_DIRS = ("/run/systemd/nspawn/propagate", "/run/systemd/nspawn", "/run/systemd/nspawn-root")


class BootError(Exception):
    """The container could not be booted: one line saying why."""


def python_binds() -> List[str]:
    """Directories the test's Python installation lives in, outside /usr (the container has the host's)."""
    dirs = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    return sorted(d for d in dirs if not d.startswith("/usr/") and d != "/usr")


def _cgroup_mounts() -> List[Tuple[str, str]]:
    """(mount point, hierarchy key in /proc/self/cgroup) of the cgroup2 and the name=systemd hierarchies."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if rest[0] == "cgroup2":
                out.append((fields[4], "0::"))
            elif rest[0] == "cgroup" and "name=systemd" in rest[-1].split(","):
                out.append((fields[4], "name=systemd"))
    return out


def _own_cgroup(key: str) -> Optional[str]:
    with open("/proc/self/cgroup") as f:
        for line in f:
            num, _, rest = line.rstrip("\n").partition(":")
            ctrl, _, path = rest.partition(":")
            if (key == "0::" and num == "0" and ctrl == "") or ctrl == key:
                return path
    return None


class Container:
    """One booted container; `run` executes a command inside it (all its namespaces)."""

    def __init__(self, workdir: Path, binds_ro: Sequence[str], binds_rw: Dict[str, str]):
        self.workdir = workdir
        self.name = f"gpu-mon-test-{os.getpid()}-{next(_SERIAL)}"
        self.binds_ro = list(binds_ro)
        self.binds_rw = dict(binds_rw)
        self.nspawn: Optional[subprocess.Popen] = None
        self.pid = 0  # the container's PID 1 (systemd), as the host sees it
        self.cgroups: List[str] = []
        self.run_dirs_before = {d for d in NSPAWN_RUN_DIRS if os.path.lexists(d)}
        self.log = workdir / f"{self.name}.log"

    # ---- boot and teardown ------------------------------------------------------------------------------
    def boot(self) -> None:
        """Start the container and wait until its systemd has finished booting; BootError if it cannot."""
        if os.geteuid() != 0:
            raise BootError("booting a container with systemd-nspawn needs root")
        tool = shutil.which("systemd-nspawn")
        if tool is None:
            raise BootError("systemd-nspawn not found: install the Debian package systemd-container")
        self._make_cgroups()
        joins = "".join(f'echo $$ > "{d}/cgroup.procs" && ' for d in self.cgroups)
        # If the test run itself dies, nspawn gets SIGTERM (and halts the container) all the same.
        setpriv = shutil.which("setpriv")
        argv = [setpriv, "--pdeathsig=TERM"] if setpriv else []
        argv += [tool, "--quiet", "--volatile=yes", "--directory=/", "--register=no", "--keep-unit"]
        argv += [f"--machine={self.name}", "--boot"]
        # Let its systemd load the eBPF device programs of DevicePolicy=/DeviceAllow= (cgroup v2): nspawn's
        # own filter refuses bpf(), and the container then enforces no device policy at all.
        argv += ["--system-call-filter=bpf"]
        argv += [f"--bind-ro={p}" for p in self.binds_ro]
        argv += [f"--bind={src}:{dst}" for src, dst in self.binds_rw.items()]
        argv += ["systemd.firstboot=off"]
        env = dict(os.environ)
        if any(key == "0::" for _mount, key in _cgroup_mounts()):
            # The container's systemd on cgroup v2 alone, as on today's servers, also where the host mixes
            # v1 and v2 (hybrid): gpu-mon's containment is a cgroup v2 feature.
            env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
        with open(self.log, "wb") as out:
            self.nspawn = subprocess.Popen(
                ["/bin/sh", "-c", joins + 'exec "$@"', "sh", *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self._wait_for_init()
        state = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=BOOT_TIMEOUT)
        if state.stdout.strip() not in ("running", "degraded"):
            raise BootError(f"the container's systemd did not finish booting: {state.stdout.strip()!r}")

    def _make_cgroups(self) -> None:
        for mount, key in _cgroup_mounts():
            own = _own_cgroup(key)
            if own is None:
                continue
            path = os.path.normpath(f"{mount}/{own.lstrip('/')}/{self.name}")
            with contextlib.suppress(OSError):
                os.mkdir(path)
                self.cgroups.append(path)

    def _wait_for_init(self) -> int:
        assert self.nspawn is not None
        deadline = time.monotonic() + BOOT_TIMEOUT
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise BootError(
                    f"systemd-nspawn exited with status {self.nspawn.returncode}: {self._log_tail()}"
                )
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.nspawn.pid).children():
                    if child.name() == "systemd" and os.path.exists(
                        f"/proc/{child.pid}/root/run/systemd/private"
                    ):
                        return child.pid
            time.sleep(0.05)
        raise BootError(f"no systemd came up in the container within {BOOT_TIMEOUT:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
            return lines[-1] if lines else "(no output)"
        return "(no output)"

    def stop(self) -> List[str]:
        """End the container (a clean halt, SIGKILL after 20 s) and remove what it left on the host; return
        what is still there (empty when all is gone)."""
        left: List[str] = []
        if self.nspawn is not None:
            self._halt()
            inside = self._processes_in(self.cgroups)
            left += [f"process {p} of the container still running" for p in inside]
        for path in self.cgroups:
            if not _remove_tree(path):
                left.append(f"cgroup {path} could not be removed")
        for d in NSPAWN_RUN_DIRS:
            if d not in self.run_dirs_before:
                with contextlib.suppress(OSError):
                    os.rmdir(d)  # only when empty: another container's are kept
        return left

    def wait_ended(self, timeout: float) -> Optional[int]:
        """systemd-nspawn's exit status once the container has ended by itself (0: powered off), or None."""
        assert self.nspawn is not None
        try:
            return self.nspawn.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _halt(self) -> None:
        assert self.nspawn is not None
        if self.nspawn.poll() is None:
            os.kill(self.nspawn.pid, signal.SIGTERM)  # nspawn asks the container's systemd to halt
            try:
                self.nspawn.wait(20)
            except subprocess.TimeoutExpired:
                for pid in (self.pid, self.nspawn.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)  # PID 1 of a namespace: its whole namespace dies
                self.nspawn.wait(10)
        with contextlib.suppress(OSError):
            os.rmdir(f"/run/systemd/nspawn/propagate/{self.name}")

    @staticmethod
    def _processes_in(cgroups: List[str]) -> List[int]:
        pids: List[int] = []
        for top in cgroups:
            for root, _dirs, _files in os.walk(top):
                with contextlib.suppress(OSError), open(os.path.join(root, "cgroup.procs")) as f:
                    pids += [int(x) for x in f.read().split()]
        return pids

    # ---- inside ----------------------------------------------------------------------------------------
    def run(
        self, argv: Sequence[str], check: bool = True, timeout: float = 60.0, input: Optional[str] = None
    ) -> subprocess.CompletedProcess:
        """Run a command in the container; with check, a failure raises with its output."""
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "SYSTEMD_PAGER": "",
            "SYSTEMD_COLORS": "0",
        }
        result = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", *argv],
            env=env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)}: exit {result.returncode}\n{result.stdout}{result.stderr}"
            )
        return result

    def path(self, inside: str) -> Path:
        """A path inside the container, as the host reaches it (through its PID 1's root)."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def write(self, inside: str, text: str, mode: int = 0o644) -> None:
        """Write a root-owned file inside the container (its /etc and /var are its own tmpfs)."""
        target = self.path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def show(self, unit: str, *props: str) -> Dict[str, str]:
        """`systemctl show` properties of a unit."""
        out = self.run(["systemctl", "show", unit, *[f"--property={p}" for p in props]]).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(
        self, unit: str, since: float = 0.0, priority: Optional[str] = None
    ) -> List[Tuple[float, str]]:
        """(time, message) of a unit's journal lines (systemd's about it included) from `since` (time.time())
        on. Filtered here, not with --after-cursor: with it, journalctl 252 was seen to leave out one of two
        lines that a process wrote in the same microsecond."""
        argv = ["journalctl", "--unit", unit, "--output=json", "--no-pager"]
        argv += [f"--priority={priority}"] if priority else []
        lines = []
        for raw in self.run(argv, check=False).stdout.splitlines():
            entry = json.loads(raw)
            if int(entry["__REALTIME_TIMESTAMP"]) / 1e6 < since:
                continue
            message = entry.get("MESSAGE")
            if isinstance(message, list):  # journald stores non-UTF-8 messages as bytes
                message = bytes(message).decode(errors="replace")
            lines.append((int(entry["__REALTIME_TIMESTAMP"]) / 1e6, str(message)))
        return lines


def _remove_tree(top: str) -> bool:
    """Remove a cgroup and its (empty) children, deepest first."""
    if not os.path.isdir(top):
        return True
    for root, _dirs, _files in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(root)
    return not os.path.exists(top)
