"""A new holder is found by the next event or poll round, never only by the periodic full scan (which these
tests push out to 10 minutes): descriptors swapped in place, handed over between processes, and a
container's own device node."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from conftest import SWAP_IN_PLACE, WORKLOAD_PYTHON, wait_for, workload_cmd

SLOW_FULL = {"full_scan_seconds": 600, "interval_seconds": 0.1, "start_delay_seconds": 0.3}


def miner(tmp_path: Path) -> str:
    cmd = workload_cmd(tmp_path)
    return f"[gpu-all]\ngpus = ALL\n\n[process-miner]\ncmd = {cmd}\ngpus = 0\nuser = root\n"


def holders_of(d, index: int) -> set:
    gpus = d.state().get("gpus") or []
    return {h["pid"] for h in gpus[index]["holders"]} if len(gpus) > index else set()


def test_a_descriptor_swapped_in_place_is_found_by_the_open_event(tmp_path, sim, daemon_factory, procs):
    # The cause of a CI flake: a poll that came in the same wake as the open event used to drop the event
    # and scan incrementally, which cannot see a same-count swap; only the 60 s full scan then found it.
    d = daemon_factory(miner(tmp_path), defaults=SLOW_FULL)
    for _ in range(3):
        d.wait_running("miner")
        p = subprocess.Popen(
            [sys.executable, "-c", SWAP_IN_PLACE, sim.device(0), os.devnull],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        procs.append(p)
        assert p.stdout.readline() == b"ready\n"
        d.poll_passed()  # a poll has cached the process's fd signature: the swap keeps its count
        p.stdin.write(b"go\n")
        p.stdin.flush()
        assert p.stdout.readline() == b"swapped\n"
        d.wait_log(rf"python.*\[{p.pid}\] holds .*nvidia0; stopping miner", timeout=5)
        p.kill()
        p.wait()


HANDOVER = """
import os, socket, sys, time
a, b = socket.socketpair()
pid = os.fork()
if pid == 0:  # the receiver: a placeholder descriptor, then the GPU's swapped onto it
    a.close()
    keep = os.open("/dev/null", os.O_RDONLY)
    msg, fds, flags, addr = socket.recv_fds(b, 16, 1)
    os.dup2(fds[0], keep)
    os.close(fds[0])
    b.send(b"k")
    time.sleep(600)
b.close()
g = os.open(sys.argv[1], os.O_RDONLY)
print(pid, flush=True)
sys.stdin.readline()
socket.send_fds(a, [b"x"], [g])
a.recv(1)
os._exit(0)  # the sender lets go: only the receiver holds the GPU now
"""


def test_a_descriptor_handed_to_another_process_is_found(tmp_path, sim, daemon_factory, procs):
    d = daemon_factory(miner(tmp_path), defaults=SLOW_FULL)
    d.wait_running("miner")
    p = subprocess.Popen(
        [sys.executable, "-c", HANDOVER, sim.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    procs.append(p)
    receiver = int(p.stdout.readline())
    try:
        d.wait_log(rf"\[{p.pid}\] holds .*nvidia0; stopping miner")
        wait_for(lambda: holders_of(d, 0) == {p.pid}, what="the sender as the only holder")
        p.stdin.write(b"go\n")
        p.stdin.flush()
        assert p.wait(10) == 0
        wait_for(lambda: receiver in holders_of(d, 0), timeout=5, what="the receiver found as the holder")
        assert d.workload("miner")["state"] != "running"
    finally:
        os.kill(receiver, 9)


CONTAINER_OPEN = "import sys, time; f = open(sys.argv[1], 'rb'); print('open', flush=True); time.sleep(600)"


def test_a_container_node_is_watched_once_seen(tmp_path, sim, daemon_factory, procs):
    # GPU 0's node is a real character device here (the number of /dev/full, which nobody holds), and the
    # "container" has its own node with the same number: another inode, which the host's watch never sees.
    rdev = os.stat("/dev/full").st_rdev
    os.unlink(sim.device(0))
    os.mknod(sim.device(0), 0o600 | stat.S_IFCHR, rdev)
    ctr = tmp_path / "ctr" / "dev" / "nvidia0"
    ctr.parent.mkdir(parents=True)
    os.mknod(ctr, 0o600 | stat.S_IFCHR, rdev)
    d = daemon_factory(miner(tmp_path), defaults={**SLOW_FULL, "interval_seconds": 0.5})
    d.wait_running("miner")
    first = subprocess.Popen([WORKLOAD_PYTHON, "-c", CONTAINER_OPEN, str(ctr)], stdout=subprocess.PIPE)
    procs.append(first)
    assert first.stdout.readline() == b"open\n"
    # The first open in a new container is found by a poll; the log names the path it opened.
    d.wait_log(rf"\[{first.pid}\] holds {ctr}; stopping miner")
    d.wait_log(rf"watching /proc/{first.pid}/root{ctr} for opens too")
    first.kill()
    first.wait()
    d.wait_running("miner")
    # Polls now come every 30 s: a stop within 5 s can only come from the open event on the watched node.
    d.write_config(d.body, defaults={"interval_seconds": 30})
    d.signal(1)  # SIGHUP
    d.wait_log("reloaded", count=1)
    d.wait_running("miner")
    d.wake_passed()  # the poll that follows a reload has passed: the next is 30 s away
    second = subprocess.Popen([WORKLOAD_PYTHON, "-c", CONTAINER_OPEN, str(ctr)], stdout=subprocess.PIPE)
    procs.append(second)
    assert second.stdout.readline() == b"open\n"
    d.wait_log(rf"\[{second.pid}\] holds {ctr}; stopping miner", timeout=5)


THREAD = """
import ctypes, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
print("ready", flush=True)
def own_table():
    assert libc.unshare(0x400) == 0  # CLONE_FILES: this thread's fd table is its own
    os.open(sys.argv[1], os.O_RDONLY)
    print("open", flush=True)
    time.sleep(600)
sys.stdin.readline()
threading.Thread(target=own_table, daemon=True).start()
time.sleep(600)
"""


def test_a_thread_with_its_own_fd_table_is_found_by_the_open_event(tmp_path, sim, daemon_factory, procs):
    d = daemon_factory(miner(tmp_path), defaults=SLOW_FULL)
    d.wait_running("miner")
    p = subprocess.Popen(
        [sys.executable, "-c", THREAD, sim.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"  # started up: its open files stay as they are until told
    d.poll_passed()  # a poll has cached the process (one thread, no GPU)
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"open\n"
    d.wait_log(rf"\[{p.pid}\] holds .*nvidia0; stopping miner", timeout=5)


MAP_AND_CLOSE = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
c = ctypes
libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
print("ready", flush=True)
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDONLY)
libc.mmap(None, 4096, 1, 1, fd, 0)
os.close(fd)  # between two looks: only the memory map is left
print("mapped", flush=True)
time.sleep(600)
"""


def test_a_node_opened_mapped_and_closed_between_two_looks_is_found(tmp_path, sim, daemon_factory, procs):
    with open(sim.device(0), "wb") as f:
        f.write(b"\0" * 4096)
    d = daemon_factory(miner(tmp_path), defaults=SLOW_FULL)
    d.wait_running("miner")
    p = subprocess.Popen(
        [sys.executable, "-c", MAP_AND_CLOSE, sim.device(0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    procs.append(p)
    assert p.stdout.readline() == b"ready\n"  # started up: its open files stay as they are until told
    d.poll_passed()  # a poll has cached the process (no GPU)
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == b"mapped\n"
    d.wait_log(rf"\[{p.pid}\] holds .*nvidia0; stopping miner", timeout=5)
