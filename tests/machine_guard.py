"""A pytest plugin: the test suite leaves the machine's own gpu-mon files as it found them.

Before the run it records the daemon's real paths (`/var/lib/gpu_mon`, `/run/gpu_mon`, `/etc/gpu_mon.conf`,
`/var/log/gpu-mon`, and `/tmp/gpu-mon-occupiers` where occupiers register; directories recursively): whether
each exists, its type, owner, mode, size, mtime and, for files, a hash of the content. After the last test of
each module it compares, so the module that changed something fails (naming the first test after which the
change was seen); after the run it compares once more and fails the run if anything differs from the start.

`GPU_MON_TEST_MACHINE_PATHS` (paths separated by `:`) replaces the guarded paths: the guard's own test uses
it to watch a temporary directory instead of the machine.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

MACHINE_PATHS = (
    "/var/lib/gpu_mon",
    "/run/gpu_mon",
    "/etc/gpu_mon.conf",
    "/var/log/gpu-mon",
    "/tmp/gpu-mon-occupiers",  # every user's `occupy` record (api/occupiers.py)
)
PATHS_ENV = "GPU_MON_TEST_MACHINE_PATHS"

Entry = Tuple[object, ...]
Snapshot = Dict[str, Entry]


def guarded_paths() -> Tuple[str, ...]:
    """The paths this run guards."""
    value = os.environ.get(PATHS_ENV)
    if value is None:
        return MACHINE_PATHS
    return tuple(p for p in value.split(os.pathsep) if p)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        return f"unreadable: {e.strerror}"
    return h.hexdigest()


def _entry(path: str, st: os.stat_result, content: bool) -> Entry:
    kind = stat.S_IFMT(st.st_mode)
    head: Entry = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    if stat.S_ISLNK(st.st_mode):
        return (*head, os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return (*head, st.st_mtime_ns)
    body: Entry = (st.st_size, st.st_mtime_ns, st.st_ino)
    return (*head, *body, _digest(path)) if content and stat.S_ISREG(st.st_mode) else (*head, *body)


def _walk(path: str, content: bool) -> Iterator[Tuple[str, Entry]]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        yield path, ("unreadable", e.strerror)
        return
    yield path, _entry(path, st, content)
    if not stat.S_ISDIR(st.st_mode):
        return
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        yield path + "/", ("unlistable", e.strerror)
        return
    for name in names:
        yield from _walk(os.path.join(path, name), content)


def snapshot(paths: Sequence[str], content: bool = True) -> Snapshot:
    """Every guarded path that exists (directories recursively) -> what it is now. Without `content`,
    files are compared by size, mtime and inode only (cheap enough to take after every test)."""
    out: Snapshot = {}
    for path in paths:
        out.update(_walk(path, content))
    return out


def differences(before: Snapshot, after: Snapshot) -> List[str]:
    """What changed, one phrase per path: `created P`, `removed P`, `changed P`."""
    out = []
    for path in sorted(set(before) | set(after)):
        if path not in before:
            out.append(f"created {path}")
        elif path not in after:
            out.append(f"removed {path}")
        elif before[path] != after[path]:
            out.append(f"changed {path}")
    return out


class MachineGuard:
    """The plugin's state for one run."""

    def __init__(self, paths: Sequence[str]):
        self.paths = tuple(paths)
        self.start = snapshot(self.paths)
        self.baseline = self.start
        self.quick = snapshot(self.paths, content=False)
        self.first_seen: Optional[str] = None

    def after_test(self, nodeid: str) -> None:
        """Cheaply note the first test after which something differs."""
        if self.first_seen is None and snapshot(self.paths, content=False) != self.quick:
            self.first_seen = nodeid

    def end_of_module(self, module: str) -> Optional[str]:
        """The failure message if the module changed a guarded path (then its changes become the new
        baseline, so that the modules after it are judged on their own)."""
        now = snapshot(self.paths)
        changes = differences(self.baseline, now)
        first, self.first_seen = self.first_seen, None
        self.baseline, self.quick = now, snapshot(self.paths, content=False)
        if not changes:
            return None
        where = f" (first seen after {first})" if first else ""
        return f"{module} changed the machine{where}: {'; '.join(changes)}"

    def end_of_run(self) -> List[str]:
        """Everything that differs from the start of the run."""
        return differences(self.start, snapshot(self.paths))


_KEY = pytest.StashKey[MachineGuard]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = MachineGuard(guarded_paths())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> Iterator[None]:
    """After a module's last test and its fixtures' teardown: fail that test if the module changed the
    machine (if the teardown failed by itself, its error is reported and the change at the end of the run)."""
    guard = item.config.stash[_KEY]
    last = nextitem is None or Path(nextitem.path) != Path(item.path)
    try:
        result = yield
    except BaseException:
        if last:
            guard.end_of_module(item.nodeid.split("::")[0])
        raise
    guard.after_test(item.nodeid)
    problem = guard.end_of_module(item.nodeid.split("::")[0]) if last else None
    if problem:
        pytest.fail(problem, pytrace=False)
    return result


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    guard = session.config.stash.get(_KEY, None)
    if guard is None:
        return
    changes = guard.end_of_run()
    if not changes:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = f"the tests changed the machine: {'; '.join(changes)}"
    if reporter is not None:
        reporter.write_line(line, red=True, bold=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
