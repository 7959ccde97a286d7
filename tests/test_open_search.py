"""After an open, the opener is looked for where it most likely is, and a stop goes out as soon as one
foreign holder is found; the rest of /proc is read after it, and status and the log show every holder.
Between two passes over every process's fd signature, a poll reads only new processes, holders and young
ones; a holder that appears with no open at all is still found: by the next poll when the process is young
or already a holder, else by the next signature pass."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

from conftest import SWAP_IN_PLACE, need_fd_counts, sleeping, wait_for, workload_cmd

from gpu_mon.api import holders, procfs
from gpu_mon.api.model import Gpu

WAIT_THEN_OPEN = """
import os, sys, time
print("ready", flush=True)
for path in sys.argv[1:]:
    sys.stdin.readline()
    os.open(path, os.O_RDONLY)
    print("open", flush=True)
time.sleep(600)
"""
OPEN_NOW = (
    "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('open', flush=True); time.sleep(600)"
)
# Holds the node, and hands its descriptor over each unix socket (fd numbers in argv) when told to.
PASSER = """
import os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
for number in sys.argv[2:]:
    sys.stdin.readline()
    socket.send_fds(socket.socket(fileno=int(number)), [b"x"], [fd])
    print("sent", flush=True)
time.sleep(600)
"""
# Receives one descriptor (at a new number: its count of open files changes) and keeps it.
RECEIVER = """
import socket, sys, time
s = socket.socket(fileno=int(sys.argv[1]))  # (kept open: the count of open files grows by the one received)
socket.recv_fds(s, 8, 1)
print("got", flush=True)
time.sleep(600)
"""


def start(procs: list, code: str, *args: str, **kw) -> subprocess.Popen:
    p = subprocess.Popen(
        [*kw.pop("argv", [sys.executable]), "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        **kw,
    )
    procs.append(p)
    if code == WAIT_THEN_OPEN:  # started up: its open files stay as they are until it is told to open
        assert p.stdout.readline() == b"ready\n"
    return p


def go(p: subprocess.Popen, expect: bytes = b"open\n") -> None:
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert p.stdout.readline() == expect


def scanner_on(device: Path) -> holders.HolderScanner:
    s = holders.HolderScanner()
    need_fd_counts(s.incremental)
    targets, problems = holders.device_targets([Gpu(index=0, uuid="GPU-0", device=str(device))])
    assert not problems
    s.set_targets(targets)
    s.full()
    return s


# ---------------------------------------------------------------------------------------- the scanner


def test_a_search_reads_the_latest_changed_process_first_and_the_next_scan_the_rest(tmp_path, procs):
    device = tmp_path / "nvidia0"
    device.touch()
    older = start(procs, WAIT_THEN_OPEN, str(device))
    latest = start(procs, WAIT_THEN_OPEN, os.devnull, str(device))
    s = scanner_on(device)
    go(latest)  # it opens something else: the scan after it remembers it as the latest that changed
    assert latest.pid in s.changed().rescanned
    go(older)  # both now hold the node, the older one first
    go(latest)
    accepted = []
    first = s.changed(enough=lambda pid, gpus: accepted.append(pid) or True)
    assert accepted == [latest.pid]
    assert not first.complete
    assert latest.pid in first.held and older.pid not in first.held
    rest = s.changed()
    assert rest.complete
    assert {latest.pid, older.pid} <= set(rest.held)
    assert {latest.pid, older.pid} <= rest.rescanned  # the search's reads are reported with the rest


def test_a_new_process_is_read_before_older_ones(tmp_path, procs):
    device = tmp_path / "nvidia0"
    device.touch()
    older = start(procs, WAIT_THEN_OPEN, str(device))
    s = scanner_on(device)
    go(older)
    new = start(procs, OPEN_NOW, str(device))
    assert new.stdout.readline() == b"open\n"
    accepted = []
    result = s.changed(enough=lambda pid, gpus: accepted.append(pid) or True)
    assert accepted == [new.pid] and not result.complete
    assert older.pid in s.changed().held


def test_a_search_that_finds_nothing_it_accepts_is_a_whole_scan(tmp_path, procs):
    device = tmp_path / "nvidia0"
    device.touch()
    p = start(procs, WAIT_THEN_OPEN, str(device))
    s = scanner_on(device)
    go(p)
    result = s.changed(enough=lambda pid, gpus: False)
    assert result.complete and p.pid in result.held


def test_newest_first_follows_the_pid_counter_round_its_wrap():
    assert procfs.newest_first([5, 300, 7, 32000, 31000], last=7) == [7, 5, 32000, 31000, 300]
    assert procfs.newest_first([5, 300, 7], last=None) == [300, 7, 5]
    assert procfs.newest_first([5, 300, 7], last=400) == [300, 7, 5]
    assert isinstance(procfs.last_pid(), int)


def test_a_light_poll_reads_new_young_and_holding_processes_only(tmp_path, procs):
    device = tmp_path / "nvidia0"
    device.touch()
    old = start(procs, WAIT_THEN_OPEN, str(device))  # seen by the first scan: not young
    s = scanner_on(device)
    young = start(procs, WAIT_THEN_OPEN, str(device))
    assert young.pid in s.fresh().rescanned  # new: read
    go(old)
    go(young)
    light = s.fresh()
    assert young.pid in light.held  # young: its signature is compared by every light poll
    assert old.pid not in light.held and old.pid not in light.rescanned  # not yet: an old, quiet process
    assert old.pid in s.changed().held  # the signature pass finds it
    old.kill()
    old.wait()
    assert s.fresh().released  # a holder that exited is noticed by a light poll


# ---------------------------------------------------------------------------------------- the daemon


def miner(tmp_path: Path, extra: str = "") -> str:
    cmd = workload_cmd(tmp_path)
    return f"[gpu-all]\ngpus = ALL\n{extra}\n[process-miner]\ncmd = {cmd}\ngpus = 0\nuser = root\n"


def holders_of(d, index: int) -> set:
    gpus = d.state().get("gpus") or []
    return {h["pid"] for h in gpus[index]["holders"]} if len(gpus) > index else set()


def test_the_opener_is_stopped_for_first_and_every_holder_is_reported(tmp_path, sim, daemon_factory, procs):
    # GPU 0's node is a character device (the number of /dev/full); a "container" has its own node with the
    # same number, whose opens no watch sees. A quiet process opens that one, then a newer process opens
    # the host's node: the open's search finds the newer one first and stops the workload; the rest of the
    # scan finds the quiet one too, before the round is published. No poll comes in between (30 s).
    rdev = os.stat("/dev/full").st_rdev
    os.unlink(sim.device(0))
    os.mknod(sim.device(0), 0o600 | stat.S_IFCHR, rdev)
    ctr = tmp_path / "ctr" / "nvidia0"
    ctr.parent.mkdir()
    os.mknod(ctr, 0o600 | stat.S_IFCHR, rdev)
    quiet = start(procs, WAIT_THEN_OPEN, str(ctr))
    opener = start(procs, WAIT_THEN_OPEN, sim.device(0))
    d = daemon_factory(
        miner(tmp_path),
        defaults={"interval_seconds": 0.2, "full_scan_seconds": 600, "start_delay_seconds": 0.3},
        args=("--debug",),
    )
    d.wait_running("miner")
    d.write_config(d.body, defaults={"interval_seconds": 30, "full_scan_seconds": 600})
    d.signal(1)  # SIGHUP
    d.wait_log("reloaded", count=1)
    d.wake_passed()  # the poll that follows a reload has passed: the next is 30 s away
    go(quiet)
    go(opener)
    d.wait_log(rf"stopping miner before reading the rest of /proc: .*\[{opener.pid}\] holds", timeout=5)
    line = d.wait_log(r"holds .*; stopping miner\[", timeout=5)[0]
    wait_for(lambda: holders_of(d, 0) == {quiet.pid, opener.pid}, timeout=5, what="both holders in status")
    assert str(quiet.pid) in line or str(opener.pid) in line  # (the first reason of the whole picture)
    assert d.workload("miner").get("state") != "running"


def test_a_descriptor_passed_to_a_process_is_found_without_an_open(tmp_path, sim, daemon_factory, procs):
    # An ignored program holds the node from before gpu-mon started (the workload runs) and hands its
    # descriptor over unix sockets to two processes that never open it, so no open event comes: one that
    # was there before gpu-mon started is found by the pass over every process's signature (every 10 s);
    # one started since is young, and found by the next poll.
    old_end, old_sock = socket.socketpair()
    young_end, young_sock = socket.socketpair()
    ends = (old_end.fileno(), young_end.fileno())
    old = start(procs, RECEIVER, str(old_sock.fileno()), pass_fds=(old_sock.fileno(),))
    passer = start(
        procs,
        PASSER,
        sim.device(0),
        *map(str, ends),
        argv=["fdpasser"],
        executable=sys.executable,
        pass_fds=ends,
    )
    assert passer.stdout.readline() == b"open\n"
    d = daemon_factory(
        miner(tmp_path, "ignore_programs = fdpasser"),
        defaults={"interval_seconds": 0.2, "full_scan_seconds": 600, "start_delay_seconds": 0.3},
    )
    d.wait_running("miner")
    go(passer, b"sent\n")
    assert old.stdout.readline() == b"got\n"
    d.wait_log(rf"\[{old.pid}\] holds .*; stopping miner", timeout=15)
    young = start(procs, RECEIVER, str(young_sock.fileno()), pass_fds=(young_sock.fileno(),))
    wait_for(lambda: sleeping(young.pid), what="the young receiver started up and waiting for the descriptor")
    d.poll_passed()  # a poll has read the new process (no GPU yet): from now on it is known, and young
    go(passer, b"sent\n")
    assert young.stdout.readline() == b"got\n"
    # The last signature pass found the old receiver just now: the next one is ~10 s away.
    wait_for(lambda: young.pid in holders_of(d, 0), timeout=5, what="the young receiver found by a poll")


def test_an_opener_that_swaps_its_descriptor_in_place_is_named_by_the_kernel(
    tmp_path, sim, daemon_factory, procs
):
    # Open, dup2 onto a descriptor it had, close the new one: its count of open files is what it was, so
    # the search by counts passes it over (a full scan would find it). fanotify names the opener: it is
    # read first and the workload is stopped before the rest of /proc is read.
    swapper = start(procs, SWAP_IN_PLACE, sim.device(0), os.devnull)
    assert swapper.stdout.readline() == b"ready\n"
    d = daemon_factory(
        miner(tmp_path),
        defaults={"interval_seconds": 0.2, "full_scan_seconds": 600, "start_delay_seconds": 0.3},
        args=("--debug",),
    )
    d.wait_running("miner")
    go(swapper, b"swapped\n")  # (polls and signature passes compare counts: only the search finds it)
    d.wait_log(rf"stopping miner before reading the rest of /proc: .*\[{swapper.pid}\] holds", timeout=5)
