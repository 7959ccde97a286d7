"""cgroup v2 containment: one child group per workload under the daemon's own group, ended by `cgroup.kill`.

`cgroup.kill` (Linux >= 5.14) SIGKILLs every process in the group, including ones forked while it runs, so a
workload that double-forks, calls setsid or forks in a loop cannot outlive its stop. The daemon may create
groups when its own group is writable: under systemd with `Delegate=yes`, or as root with a cgroup2 mount.
Groups are named `gpu-mon.<daemon pid>.<leader pid>`; no controller is enabled, so the daemon may stay in
the parent group (the "no internal processes" rule applies only to groups with controllers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from typing import List, Optional, Tuple

from gpu_mon.api import procfs

PREFIX = "gpu-mon."


def own_group_dir(proc: str = procfs.PROC) -> Tuple[Optional[str], str]:
    """Directory of this process's cgroup v2 group, or (None, why not)."""
    try:
        with open(f"{proc}/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError as err:
        return None, f"cannot read {proc}/self/cgroup: {err.strerror}"
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None, "no cgroup v2 hierarchy (cgroup v1 only)"
    mount = _cgroup2_mount(path, proc)
    if mount is None:
        return None, "the cgroup v2 hierarchy is not mounted here"
    mountpoint, root = mount
    rel = path[len(root) :] if root != "/" else path
    return os.path.normpath(mountpoint + "/" + rel.lstrip("/")), ""


def _cgroup2_mount(path: str, proc: str) -> Optional[Tuple[str, str]]:
    """(mount point, mounted root) of a cgroup2 mount that contains `path`."""
    try:
        with open(f"{proc}/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep or not right.startswith("cgroup2 "):
            continue
        fields = left.split()
        root, mountpoint = _unescape(fields[3]), _unescape(fields[4])
        if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
            return mountpoint, root
    return None


def root_mount(proc: str = procfs.PROC) -> Optional[str]:
    """Where the whole cgroup v2 hierarchy is mounted (its root, as systemd sees it), or None."""
    mount = _cgroup2_mount("/", proc)
    return mount[0] if mount is not None and mount[1] == "/" else None


def _unescape(field: str) -> str:
    """mountinfo escapes blanks, tabs, newlines and backslashes as octal (\\040)."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


class CgroupTree:
    """Creates, kills and removes the workloads' groups under one parent directory."""

    def __init__(self, parent: str, daemon_pid: int):
        self.parent = parent
        self.daemon_pid = daemon_pid

    @classmethod
    def probe(cls, daemon_pid: int, proc: str = procfs.PROC) -> Tuple[Optional[CgroupTree], str]:
        """A tree under our own group if we may create groups there (tried for real), else (None, why)."""
        parent, why = own_group_dir(proc)
        if parent is None:
            return None, why
        tree = cls(parent, daemon_pid)
        test = os.path.join(parent, f"{PREFIX}{daemon_pid}.probe")
        try:
            os.mkdir(test)
        except OSError as err:
            return None, f"cannot create a group in {parent}: {err.strerror}"
        has_kill = os.path.exists(os.path.join(test, "cgroup.kill"))
        with contextlib.suppress(OSError):
            os.rmdir(test)
        if not has_kill:
            return None, "the kernel has no cgroup.kill (Linux < 5.14)"
        tree.remove_stale()
        return tree, ""

    def create(self, leader_pid: int) -> str:
        """Make the group for one workload and move its leader into it; return the group's directory."""
        path = os.path.join(self.parent, f"{PREFIX}{self.daemon_pid}.{leader_pid}")
        os.mkdir(path)
        try:
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(leader_pid))
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
            raise
        return path

    def remove_stale(self) -> List[str]:
        """End the groups that dead daemons left behind: their workloads (gpu-mon started them) are killed
        if the daemon and its leader were both killed at once, and the empty groups removed. Groups of a
        daemon that is alive (another state file) are left alone."""
        removed = []
        with contextlib.suppress(OSError):
            for name in os.listdir(self.parent):
                path = os.path.join(self.parent, name)
                owner = _daemon_pid(name)
                if owner is None or owner == self.daemon_pid or _alive(owner) or not os.path.isdir(path):
                    continue
                if _leader_in(name, path):
                    continue  # its leader gives its workload the stop and grace it was due: left to finish
                if populated(path):
                    kill(path)
                if remove(path):
                    removed.append(name)
        return removed


def _daemon_pid(name: str) -> Optional[int]:
    """The daemon pid in a group name `gpu-mon.<daemon>.<leader>` (or `.probe`), else None."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] + "." != PREFIX or not parts[1].isdigit():
        return None
    return int(parts[1])


def _leader_in(name: str, path: str) -> bool:
    """Whether the leader named in a group's name `gpu-mon.<daemon>.<leader>` is in that group, alive (a
    dead daemon's leader stopping its workload itself, as its daemon died)."""
    leader = name.split(".")[-1]
    return leader.isdigit() and int(leader) in procs(path) and _alive(int(leader))


def _alive(pid: int) -> bool:
    st = procfs.read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def kill(path: str) -> bool:
    """SIGKILL every process in the group (and the ones it forks meanwhile); False if that failed."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
        return True
    except OSError as err:
        return err.errno == errno.ENOENT  # already removed: nothing left to kill


def procs(path: str) -> List[int]:
    """The processes in the group now (empty when it is gone or cannot be read)."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def signal_all(path: str, sig: int) -> int:
    """Send `sig` to every process in the group; return how many got it. Each is held by a pidfd first and
    signalled only if it is still in the group then (so a pid reused meanwhile is never signalled)."""
    fds = {}
    for pid in procs(path):
        with contextlib.suppress(OSError):
            fds[pid] = os.pidfd_open(pid)
    sent = 0
    try:
        still = set(procs(path))
        for pid, fd in fds.items():
            if pid in still:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(fd, sig)
                    sent += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return sent


def populated(path: str) -> bool:
    """Whether any process is left in the group (True when unsure: fail closed)."""
    try:
        with open(os.path.join(path, "cgroup.events")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "populated":
                    return value.strip() != "0"
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return True


def remove(path: str) -> bool:
    """Remove an empty group; False while it is still populated."""
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


class ContainmentError(Exception):
    """`containment = cgroup` was asked for and cannot be had; str() is one line."""


def choose(mode: str, daemon_pid: int) -> Tuple[Optional[CgroupTree], str]:
    """The cgroup tree to contain workloads in (None: the subreaper), and how to say which one it is."""
    if mode == "subreaper":
        return None, "subreaper (containment = subreaper)"
    tree, why = CgroupTree.probe(daemon_pid)
    if tree is None and mode == "cgroup":
        raise ContainmentError(f"containment = cgroup, but {why}")
    if tree is None:
        return None, f"subreaper ({why})"
    return tree, f"cgroup (a group per workload under {tree.parent})"
