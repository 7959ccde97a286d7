"""The full scan reads again only processes that ran since it last read them (a process that has not run
cannot have changed its fd table or its maps), every process when asked; and a scan that gives way to an
open goes on afterwards where it stopped, with the holders it had found."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SWAP_IN_PLACE, need_fd_counts, wait_for

from gpu_mon.api import holders, procfs
from gpu_mon.api.model import Gpu
from gpu_mon.engine.inotify import Inotify

IDLE = "import sys; print('ready', flush=True); sys.stdin.read()"


@pytest.fixture
def node(tmp_path: Path) -> Path:
    path = tmp_path / "nvidia0"
    path.touch()
    return path


def start(procs: list, code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"
    return p


def waiting(pid: int) -> bool:
    """Whether a process sleeps (ours block in a read: they run again only when input comes)."""
    st = procfs.read_stat(pid)
    return st is not None and st.state == "S"


def scanner_on(node: Path) -> holders.HolderScanner:
    s = holders.HolderScanner(skip_pids=(os.getpid(),))
    need_fd_counts(s.incremental)
    targets, problems = holders.device_targets([Gpu(index=0, uuid="GPU-0", device=str(node))])
    assert not problems
    s.set_targets(targets)
    return s


def test_the_kernel_counts_how_often_a_process_runs():
    before = procfs.read_ran(os.getpid())
    assert before is not None and before[1] > 0
    subprocess.run(["true"], check=True)  # (we sleep while it runs: scheduled in again after)
    after = procfs.read_ran(os.getpid())
    assert after is not None and after[0] > before[0] and after[1] > before[1]
    assert procfs.read_ran(2**22 + 7) is None


def test_a_full_scan_reads_again_only_processes_that_ran(node, procs):
    idle = start(procs, IDLE)
    wait_for(lambda: waiting(idle.pid), what="the idle process to wait for input")  # (it runs on a moment)
    s = scanner_on(node)
    assert int(idle.pid) in s.full().rescanned  # (the first reads every process)
    assert idle.pid not in s.full().rescanned
    assert idle.pid in s.full(every=True).rescanned
    ran = procfs.read_ran(idle.pid)
    idle.stdin.write(b"x")  # it runs (reads one byte), and is read again
    idle.stdin.flush()
    wait_for(lambda: procfs.read_ran(idle.pid) != ran, what="the idle process to run")
    assert idle.pid in s.full().rescanned


def test_a_descriptor_swapped_in_place_is_found_by_the_next_full_scan(node, procs, tmp_path):
    other = tmp_path / "other"
    other.touch()
    p = start(procs, SWAP_IN_PLACE, str(node), str(other))
    s = scanner_on(node)
    s.full()
    assert p.pid not in s.full().held
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"swapped\n"
    assert p.pid not in s.changed().held  # (its count of open files did not change)
    assert s.full().held[p.pid] == {"GPU-0"}


def test_a_holder_is_read_by_every_full_scan(node, procs):
    p = start(
        procs, f"import sys; f = open({str(node)!r}, 'rb'); print('ready', flush=True); sys.stdin.read()"
    )
    s = scanner_on(node)
    s.full()
    result = s.full()
    assert p.pid in result.rescanned and result.held[p.pid] == {"GPU-0"}


def test_a_full_scan_paused_for_an_open_goes_on_where_it_stopped(node, procs):
    holder = start(
        procs, f"import sys; f = open({str(node)!r}, 'rb'); print('ready', flush=True); sys.stdin.read()"
    )
    idle = [start(procs, IDLE) for _ in range(3)]
    s = scanner_on(node)
    watch = Inotify()
    try:
        assert watch.watch([str(node)]) == {}
        with open(node, "rb"):  # an open waits to be read: the scan gives way at once
            pass
        paused = s.full(pause=watch.pending)
        assert paused.paused and not paused.complete and not paused.full
        assert s.full_paused()
        gone = idle.pop()
        gone.kill()
        gone.wait()
        procs.remove(gone)
        late = start(procs, IDLE)
        assert watch.read() == ([str(node)], False)
        done = s.full(pause=watch.pending)  # goes on (nothing waits now) and finishes
        assert done.full and done.complete and not done.paused and not s.full_paused()
        assert done.held == {holder.pid: frozenset({"GPU-0"})}
        assert set(paused.rescanned) | set(done.rescanned) >= {holder.pid, *(p.pid for p in idle)}
        assert late.pid in s.changed().rescanned  # (it started while the scan waited: the next look reads it)
        assert str(gone.pid) not in s._cache  # (it exited while the scan waited)
    finally:
        watch.close()


def test_a_full_scan_without_pause_starts_over_and_finishes(node, procs):
    start(procs, IDLE)
    s = scanner_on(node)
    s.full()
    assert s.full(every=True, pause=lambda: True).paused
    result = s.full()
    assert result.full and not s.full_paused()


def crowd(procs: list, n: int) -> None:
    """Start sleeping processes until /proc lists at least `n` (a fresh container may have a dozen)."""
    while len(list(procfs.list_pids())) < n:
        procs.append(subprocess.Popen(["sleep", "600"]))


def test_a_signature_pass_paused_for_an_open_reports_what_it_read_with_the_next(node, procs):
    crowd(procs, 2 * holders._PAUSE_EVERY + 8)  # (the pass asks whether to pause every so many processes)
    s = scanner_on(node)
    s.full()
    p = start(
        procs, f"import sys; f = open({str(node)!r}, 'rb'); print('ready', flush=True); sys.stdin.read()"
    )
    asked = []
    paused = s.changed(pause=lambda: asked.append(1) or len(asked) > 1)
    assert paused.paused and not paused.complete
    result = s.changed()
    assert result.complete and result.held[p.pid] == {"GPU-0"}
    assert set(paused.rescanned) <= result.rescanned


def test_fanotify_names_the_opener(node, procs):
    from gpu_mon.engine.fanotify import Fanotify

    group = Fanotify()  # (root: CAP_SYS_ADMIN)
    try:
        assert group.watch([str(node)]) == {}
        p = start(procs, SWAP_IN_PLACE, str(node), os.devnull)
        p.stdin.write(b"go\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"swapped\n"
        wait_for(lambda: group.read() or group.pids, what="the open's event")
        assert group.take() == (p.pid,)
        assert group.take() == ()
    finally:
        group.close()


def test_the_openers_the_kernel_names_are_read_first_even_when_their_count_did_not_change(node, procs):
    p = start(procs, SWAP_IN_PLACE, str(node), os.devnull)
    s = scanner_on(node)
    s.full()
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"swapped\n"  # (open + dup2 in place: its count of open files is the same)
    accepted = []
    result = s.changed(enough=lambda pid, gpus: accepted.append(pid) or True, first=[p.pid, os.getpid()])
    assert accepted == [p.pid] and not result.complete and result.held[p.pid] == {"GPU-0"}
    assert result.rescanned == {p.pid}  # (read first, and nothing else: the search stopped there)


MAP_AND_CLOSE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
print("ready", flush=True)
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDONLY)
libc.mmap(None, 4096, 1, 1, fd, 0)  # (Python's own mmap would keep a copy of the descriptor)
os.close(fd)  # only the memory map is left
print("mapped", flush=True)
sys.stdin.read()
"""


def test_a_map_made_before_a_read_that_left_maps_alone_is_found_by_the_next_maps_scan(node, procs):
    node.write_bytes(b"\0" * 4096)
    p = start(procs, MAP_AND_CLOSE, str(node))
    s = scanner_on(node)
    s.full(maps=True)
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"mapped\n"
    # An open's search reads it (fds only: no GPU) after the map was made; it has not run since.
    assert p.pid not in s.changed(enough=lambda pid, gpus: True, first=[p.pid]).held
    assert p.pid not in s.full().held  # (its descriptors: nothing)
    assert s.full(maps=True).held[p.pid] == {"GPU-0"}
