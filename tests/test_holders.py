"""Holder scan with real processes holding simulated (and real character) device files."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import need_fd_counts, wait_for

from gpu_mon.api import holders, procfs
from gpu_mon.api.model import Gpu
from gpu_mon.api.text import sanitize

HOLD = """
import ctypes, os, sys, time
name = sys.argv[1]
if name:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()), 0, 0, 0)  # PR_SET_NAME
files = [open(p, "rb") for p in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.read()
"""


class Holding:
    """Real processes that open files and keep them open until the test ends."""

    def __init__(self):
        self.procs: List[subprocess.Popen] = []

    def start(self, *paths: str, name: str = "", argv0: str = "") -> subprocess.Popen:
        args = [argv0 or sys.executable, "-c", HOLD, name, *paths]
        p = subprocess.Popen(args, executable=sys.executable, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        p.kill()
        p.wait()

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def holding():
    h = Holding()
    yield h
    h.close()


def gpus_for(*paths: str) -> List[Gpu]:
    return [Gpu(index=i, uuid=f"GPU-{i}", device=p) for i, p in enumerate(paths)]


def scanner_for(*paths: str) -> holders.HolderScanner:
    targets, problems = holders.device_targets(gpus_for(*paths))
    assert problems == {}
    s = holders.HolderScanner(skip_pids=(os.getpid(),))
    s.set_targets(targets)
    return s


@pytest.fixture
def devices(tmp_path: Path) -> List[str]:
    paths = []
    for i in range(2):
        p = tmp_path / f"nvidia{i}"
        p.touch()
        paths.append(str(p))
    return paths


def test_finds_holders_of_simulated_devices(devices, holding):
    a = holding.start(devices[0])
    b = holding.start(devices[0], devices[1])
    other = holding.start(os.devnull)
    result = scanner_for(*devices).full()
    assert result.held[a.pid] == {"GPU-0"}
    assert result.held[b.pid] == {"GPU-0", "GPU-1"}
    assert other.pid not in result.held
    assert os.getpid() not in result.held


def test_finds_holder_through_a_hard_link(devices, holding, tmp_path):
    link = tmp_path / "elsewhere" / "renamed-node"
    link.parent.mkdir()
    os.link(devices[1], link)
    p = holding.start(str(link))
    assert scanner_for(*devices).full().held[p.pid] == {"GPU-1"}


def test_char_device_matches_by_rdev_under_another_path(tmp_path, holding):
    # A container's own /dev/nvidia0 is another inode with the same device number: match by st_rdev.
    twin = tmp_path / "null-twin"
    os.mknod(twin, 0o666 | stat.S_IFCHR, os.stat(os.devnull).st_rdev)
    p = holding.start(str(twin))
    held = scanner_for(os.devnull).full().held
    assert held[p.pid] == {"GPU-0"}


def test_control_node_holders_are_not_attributed(tmp_path, devices, holding):
    ctl = tmp_path / "nvidiactl"
    ctl.touch()
    p = holding.start(str(ctl))
    assert p.pid not in scanner_for(*devices).full().held


@pytest.mark.parametrize(
    "name",
    ["with space", "a) (b", "x)\ny", "))(", "ünï😀"],
    ids=["space", "parens", "newline", "only-parens", "unicode"],
)
def test_hostile_process_names(devices, holding, name):
    p = holding.start(devices[0], name=name)
    result = scanner_for(*devices).full()
    h = holders.describe(p.pid, result.held[p.pid])
    expected = name.encode()[:15].decode("utf-8", "ignore")  # the kernel keeps 15 bytes of comm
    assert h is not None and h.name.startswith(expected[:5])
    assert h.pid == p.pid and h.user == "root" and h.gpus == {"GPU-0"}
    assert "\n" not in sanitize(h.label)


def test_stat_parser_handles_names_that_look_like_fields(holding, devices):
    p = holding.start(devices[0], name="x) S 1 2 3 (y")
    st = procfs.read_stat(p.pid)
    assert st is not None and st.comm == "x) S 1 2 3 (y" and st.ppid == os.getpid()


def test_processes_exiting_mid_scan(devices):
    # Many processes open the device and exit while we scan over and over: never an error, never denied.
    code = "import sys, os; f = open(sys.argv[1]); os._exit(0)"
    s = scanner_for(*devices)
    procs = []
    for round_ in range(30):
        procs += [subprocess.Popen([sys.executable, "-c", code, devices[0]]) for _ in range(5)]
        result = s.full() if round_ % 2 else s.changed()
        assert result.denied == [] or all(procfs.read_stat(p) is not None for p in result.denied)
        for p in list(procs):
            if p.poll() is not None:
                procs.remove(p)
    for p in procs:
        p.wait()
    assert not any(pid in s.full().held for pid in [p.pid for p in procs])


def test_vanished_pid_is_skipped(devices, holding):
    p = holding.start(devices[0])
    s = scanner_for(*devices)
    assert p.pid in s.full().held
    holding.stop(p)
    assert p.pid not in s.full(pids=[str(p.pid)]).held
    assert holders.describe(p.pid, frozenset()) is None


def test_incremental_scan_finds_new_openers(devices, holding):
    s = scanner_for(*devices)
    need_fd_counts(s.incremental)
    quiet = holding.start(devices[1])  # a holder that changes nothing from now on
    s.full()
    # An old process that opens the device later (its fd count changes) ...
    code = (
        "import sys; print('ready', flush=True); sys.stdin.readline(); f = open(sys.argv[1]); "
        "print('open', flush=True); sys.stdin.read()"
    )
    old = subprocess.Popen(
        [sys.executable, "-c", code, devices[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    holding.procs.append(old)
    # Scanned once it is quiet: caught during its start-up with an import's file open, its count could come
    # back to the same number when the device takes that file's place (the daemon's open event covers that).
    assert old.stdout.readline() == b"ready\n"
    s.changed()
    old.stdin.write(b"go\n")
    old.stdin.flush()
    assert old.stdout.readline() == b"open\n"
    # ... and a brand-new process.
    new = holding.start(devices[0])
    result = s.changed()
    assert result.held[old.pid] == {"GPU-1"} and result.held[new.pid] == {"GPU-0"}
    assert old.pid in result.rescanned and new.pid in result.rescanned
    # It did not read everything: a process that changed nothing was not read again (a count of what was
    # read would depend on whatever else the machine is doing), and it still holds its GPU.
    assert quiet.pid not in result.rescanned and result.held[quiet.pid] == {"GPU-1"}


def test_incremental_scan_misses_same_count_swap_but_full_scan_finds_it(devices, holding, tmp_path):
    # Documented limit: close one fd and open the GPU in its place, and the fd count stays the same.
    other = tmp_path / "other"
    other.touch()
    code = (
        "import os, sys; fd = os.open(sys.argv[2], os.O_RDONLY); print('a', flush=True); "
        "sys.stdin.readline();"
        "os.close(fd); fd2 = os.open(sys.argv[1], os.O_RDONLY); print('b', flush=True); sys.stdin.read()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, devices[0], str(other)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    holding.procs.append(p)
    assert p.stdout.readline() == b"a\n"
    s = scanner_for(*devices)
    s.full()
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"b\n"
    assert p.pid not in s.changed().held
    assert s.full().held[p.pid] == {"GPU-0"}


def _scan_as_nobody(devices: List[str]) -> List[int]:
    """Fork, drop to nobody, scan: processes of root must be reported as denied, not skipped."""
    s = scanner_for(*devices)  # stat the devices while still root (they live in a 0700 directory)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            os.write(w, (" ".join(str(p) for p in s.full().denied) + "\n").encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return [int(x) for x in out.split()]


def test_processes_we_may_not_inspect_are_denied(devices, holding):
    p = holding.start(devices[0])  # a root process holding the GPU
    denied = _scan_as_nobody(devices)
    assert p.pid in denied
    # Kernel threads (kthreadd...) refuse non-root too, but hold no files: never a possible holder.
    stats = [procfs.read_stat(int(pid)) for pid in procfs.list_pids()]
    kernel = {st.pid for st in stats if st is not None and st.kernel_thread}
    assert kernel.isdisjoint(denied)
    # there were some to leave out, unless /proc shows a PID namespace of a container (only its init has
    # no parent there; on a host kthreadd, pid 2, has none either)
    assert kernel or [st.pid for st in stats if st is not None and st.ppid == 0] == [1]


def test_denied_records_name_and_user(holding, devices):
    p = holding.start(devices[0], name="secretive")
    (d,) = holders.describe_denied([p.pid])
    assert (d.pid, d.user, d.name) == (p.pid, "root", "secretive")
    assert d.label == f"root secretive[{p.pid}]"


def test_device_targets_problems(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    gpus = [
        Gpu(index=0, uuid="GPU-a", device=str(tmp_path / "missing")),
        Gpu(index=1, uuid="GPU-b", device=None),
        Gpu(index=2, uuid="GPU-c", device=str(fifo)),
        Gpu(index=3, uuid=None, device=str(fifo)),
    ]
    targets, problems = holders.device_targets(gpus)
    assert targets == holders.Targets()
    assert "No such file" in problems["GPU-a"] and problems["GPU-b"] == "device node unknown"
    assert "not a character device or regular file" in problems["GPU-c"]


def test_display_name_uses_argv0_when_comm_is_cut():
    assert procfs.display_name("a-very-long-pro", "a-very-long-program-name") == "a-very-long-program-name"
    assert procfs.display_name("python3", "python3.11") == "python3"


def test_ancestors_and_descendants():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '60'])"])
    try:
        kids = wait_for(lambda: procfs.descendants(p.pid) or None, what="grandchild")
        (grandchild,) = kids
        assert p.pid in list(procfs.ancestors(grandchild))
        assert os.getpid() in list(procfs.ancestors(grandchild))
    finally:
        os.kill(grandchild, signal.SIGKILL)
        p.wait()


def test_sanitize_escapes_control_characters():
    assert sanitize("a\nb\x1b[0m\x85\u2028c") == "a\\x0ab\\x1b[0m\\x85\\u2028c"
    assert sanitize("x" * 300, limit=10) == "x" * 10 + "..."


def test_fd_count_probe_matches_kernel():
    before = os.stat("/proc/self/fd").st_size
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        supported = os.stat("/proc/self/fd").st_size == before + 1
    finally:
        os.close(fd)
    assert holders.fd_count_supported() is supported


def test_incremental_scan_does_not_trust_an_entry_left_by_a_reused_pid(devices, holding):
    # pid_max can be 32768, so between two scans a pid may die and be given to a new process with the same
    # number of open fds. The cache must not take the new process for the old one.
    s = scanner_for(*devices)
    p = holding.start(devices[0])
    s.full()
    entry = s._cache[str(p.pid)]
    assert entry.gpus == {"GPU-0"}
    ino, ctime, count = entry.signature
    # What the cache would hold had another process with this pid and fd count held nothing.
    s._cache[str(p.pid)] = holders._Entry((ino + 1, ctime - 1, count), frozenset())
    result = s.changed()
    assert result.held[p.pid] == {"GPU-0"} and p.pid in result.rescanned


THREAD_TABLE = """
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def own_table():
    assert libc.unshare(0x400) == 0  # CLONE_FILES: this thread's fd table is its own from now on
    fd = os.open(sys.argv[1], os.O_RDONLY)
    print("open", flush=True)
    time.sleep(600)
sys.stdin.readline()
threading.Thread(target=own_table, daemon=True).start()
sys.stdin.read()
"""


def test_a_thread_with_its_own_fd_table_is_found(devices, holding):
    p = subprocess.Popen(
        [sys.executable, "-c", THREAD_TABLE, devices[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    holding.procs.append(p)
    s = scanner_for(*devices)
    s.full()
    assert p.pid not in s.full().held
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"open\n"
    # The process's own table need not change, so the incremental scan may not tell (the daemon's open
    # event then asks for a full scan: tests/test_yield.py); a full scan reads the thread's table.
    result = s.full()
    assert result.held[p.pid] == {"GPU-1"}
    # From now on its private table is part of its signature: a change there is incremental.
    assert s._cache[str(p.pid)].private


MAP_ONLY = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
fd = os.open(sys.argv[1], os.O_RDONLY)
addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
assert addr not in (None, ctypes.c_void_p(-1).value)
print("mapped", flush=True)
sys.stdin.readline()
os.close(fd)  # the mapping outlives the descriptor
print("closed", flush=True)
sys.stdin.read()
"""


def test_a_memory_map_that_outlives_the_descriptor_is_found(tmp_path, devices, holding):
    node = tmp_path / "nvidia-mapped"
    node.write_bytes(b"\0" * 4096)
    p = subprocess.Popen(
        [sys.executable, "-c", MAP_ONLY, str(node)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    holding.procs.append(p)
    assert p.stdout.readline() == b"mapped\n"
    s = scanner_for(str(node))
    assert s.full().held[p.pid] == {"GPU-0"}  # through the descriptor
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"closed\n"
    # The descriptor is gone: the incremental scan re-reads it (its count changed) and finds the map.
    result = s.changed() if s.incremental else s.full(maps=True)
    assert result.held.get(p.pid) == {"GPU-0"}
    assert result.released is False
    # A fresh scanner finds it only when it reads maps (the periodic full scan does).
    assert p.pid not in scanner_for(str(node)).full().held
    assert scanner_for(str(node)).full(maps=True).held[p.pid] == {"GPU-0"}


def test_a_holder_letting_go_asks_for_a_full_scan(devices, holding):
    p = holding.start(devices[0])
    s = scanner_for(*devices)
    assert not s.full().released
    holding.stop(p)
    assert s.changed().released if s.incremental else s.full(pids=[str(p.pid)]).released


def test_container_node_is_reported_for_watching(tmp_path, holding):
    # A container's own node for the GPU: same device number, another inode, opened under its own path.
    host = tmp_path / "host-nvidia0"
    ctr = tmp_path / "ctr" / "dev" / "nvidia0"
    ctr.parent.mkdir(parents=True)
    rdev = os.stat("/dev/full").st_rdev
    os.mknod(host, 0o600 | stat.S_IFCHR, rdev)
    os.mknod(ctr, 0o600 | stat.S_IFCHR, rdev)
    p = holding.start(str(ctr))
    s = scanner_for(str(host))
    result = s.full()
    assert result.held[p.pid] == {"GPU-0"}
    assert ("GPU-0", str(ctr)) in result.nodes[p.pid]
    (watch,) = [path for uuid, path in s.extra_nodes.values() if uuid == "GPU-0"]
    assert watch == f"/proc/{p.pid}/root{ctr}"
    assert os.stat(watch).st_ino == os.stat(ctr).st_ino


def _copy_exe(tmp_path: Path, owner: int) -> Path:
    exe = tmp_path / f"bin{owner}" / "nvidia-smi"
    exe.parent.mkdir()
    with open(sys.executable, "rb") as src, open(exe, "wb") as dst:
        dst.write(src.read())
    os.chmod(exe, 0o755)
    os.chown(exe, owner, owner)
    return exe


@pytest.mark.parametrize("owner,monitor", [(0, True), (65534, False)], ids=["root-owned", "user-owned"])
def test_builtin_monitor_needs_a_root_owned_executable(tmp_path, devices, holding, owner, monitor):
    exe = _copy_exe(tmp_path, owner)
    env = {**os.environ, "PYTHONHOME": sys.base_prefix}
    p = subprocess.Popen(
        [str(exe), "-c", HOLD, "", devices[0]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    holding.procs.append(p)
    assert p.stdout.readline() == b"ready\n"
    h = holders.describe(p.pid, frozenset({"GPU-0"}))
    assert h is not None and h.name == "nvidia-smi"
    assert h.monitor is monitor


def test_a_process_merely_named_like_a_monitor_is_not_one(devices, holding):
    p = holding.start(devices[0], name="nvidia-smi", argv0="nvidia-smi")
    h = holders.describe(p.pid, frozenset({"GPU-0"}))
    assert h is not None and h.name == "nvidia-smi" and h.monitor is False


def _replace_node(path: str) -> None:
    """Rename a simulated device file aside and make a new one at its path (as the simulator does)."""
    os.rename(path, path + ".old")
    Path(path).touch()


def test_a_renamed_node_still_held_counts_by_what_is_held(devices, holding):
    p = holding.start(devices[0])
    s = scanner_for(*devices)
    assert s.full().held[p.pid] == {"GPU-0"}
    _replace_node(devices[0])  # the holder keeps the old inode; the path is a new file
    targets, problems = holders.device_targets(gpus_for(*devices))
    assert problems == {}
    s.set_targets(targets)
    assert s.full().held[p.pid] == {"GPU-0"}
    assert s.changed().held[p.pid] == {"GPU-0"}
    newcomer = holding.start(devices[0])  # the new node is GPU 0's too
    assert s.full().held[newcomer.pid] == {"GPU-0"}


def test_a_replaced_node_is_forgotten_once_nothing_holds_it(devices, holding):
    p = holding.start(devices[0])
    s = scanner_for(*devices)
    s.full()
    _replace_node(devices[0])
    s.set_targets(holders.device_targets(gpus_for(*devices))[0])
    assert s.full(maps=True).held[p.pid] == {"GPU-0"}
    holding.stop(p)
    late = holding.start(devices[0] + ".old")  # soon after: still counts (unsure means busy)
    assert s.full(maps=True).held[late.pid] == {"GPU-0"}
    holding.stop(late)
    for _ in range(holders._MAPS_ROUNDS):  # every process's maps read once with no holder of the old node
        s.full(maps=True)
    other = holding.start(devices[0] + ".old")  # now an ordinary file that happens to have that inode
    assert other.pid not in s.full(maps=True).held


def test_a_memory_map_of_a_renamed_node_still_counts(tmp_path, devices, holding):
    code = (
        "import mmap, sys\n"
        "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); f.close()\n"
        "print('ready', flush=True); sys.stdin.read()"
    )
    with open(devices[1], "wb") as f:
        f.truncate(4096)
    p = subprocess.Popen(
        [sys.executable, "-c", code, devices[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    holding.procs.append(p)
    assert p.stdout.readline() == b"ready\n"
    s = scanner_for(*devices)
    assert s.full(maps=True).held[p.pid] == {"GPU-1"}
    _replace_node(devices[1])
    s.set_targets(holders.device_targets(gpus_for(*devices))[0])
    wait_for(lambda: p.pid in s.full(maps=True).held, what="the mapping found on its maps turn")
    assert s.full(maps=True).held[p.pid] == {"GPU-1"}


def test_a_replaced_node_outlives_a_look_where_its_gpu_could_not_be_read(devices, holding):
    p = holding.start(devices[0])
    s = scanner_for(*devices)
    s.full()
    _replace_node(devices[0])
    s.set_targets(holders.device_targets(gpus_for(*devices))[0])
    only_gpu1 = [Gpu(index=1, uuid="GPU-1", device=devices[1])]
    s.set_targets(holders.device_targets(only_gpu1)[0])  # GPU 0 unreadable for a look
    assert p.pid not in s.full().held
    s.set_targets(holders.device_targets(gpus_for(*devices))[0])  # and back
    assert s.full().held[p.pid] == {"GPU-0"}
