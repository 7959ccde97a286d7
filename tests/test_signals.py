"""The daemon's signals: each one either has a documented meaning or is ignored, and none leaves workloads
behind. Also: a reload never delays a yield, and untrusted names are escaped in what the admin reads."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import GPU_MON, WORKLOAD_PYTHON, pid_alive, wait_for, workload_cmd


def miner(tmp_path: Path, extra: str = "") -> str:
    cmd = workload_cmd(tmp_path)
    return f"[gpu-all]\ngpus = ALL\n\n[process-miner]\ncmd = {cmd}\ngpus = 0\nuser = root\n{extra}"


@pytest.mark.parametrize(
    "sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM], ids=["USR1", "USR2", "ALRM"]
)
def test_stray_signals_neither_kill_the_daemon_nor_its_workloads(tmp_path, sim, daemon_factory, sig):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    leader = int(d.workload("miner")["pid"])
    for i in range(3):
        d.signal(sig)
        subprocess.run(["kill", f"-{sig.name[3:]}", str(leader)], check=True)  # the leader shrugs too
        if sig == signal.SIGUSR1:  # (one at a time: the kernel merges a signal sent again before delivery)
            d.wait_log(r"status: 1/2 GPUs running work", count=i + 1)
    d.signal(signal.SIGUSR1)
    d.wait_log(r"status: ")  # the loop still answers
    assert d.proc.poll() is None and pid_alive(pid) and pid_alive(leader)
    assert d.workload("miner")["state"] == "running"


def test_sigquit_stops_like_sigterm(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    d.signal(signal.SIGQUIT)
    assert d.proc.wait(20) == 0
    assert not pid_alive(pid)


def test_a_reload_with_a_huge_config_does_not_delay_a_yield(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path))
    d.wait_running("miner")
    # 1 MB of config whose every line is a problem: slow to check, and it must be checked off the loop.
    junk = "".join(f"key_{i:06d} = {'v' * 40}\n" for i in range(18_000))
    d.write_config(d.body + "[process-junk]\ncmd = x\n" + junk)
    d.signal(signal.SIGHUP)
    opener = subprocess.Popen(
        [
            WORKLOAD_PYTHON,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print(1, flush=True); time.sleep(60)",
            sim.device(0),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert opener.stdout.readline() == b"1\n"
        opened = time.time()
        line = d.wait_log(rf"\[{opener.pid}\] holds .*; stopping miner")[0]
        stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        assert stamp - opened < 2.0, line  # the log's own clock: milliseconds since the open
        failed = d.wait_log(r"reload failed \(18000 problem\(s\)\)")[0]
        # The yield did not wait for the reload: it was logged while the config was still being checked.
        lines = d.log().splitlines()
        assert lines.index(line) < lines.index(failed), "the stop waited for the reload"
    finally:
        opener.kill()
        opener.wait()


def test_bidi_and_control_characters_are_escaped_everywhere(tmp_path, sim, daemon_factory):
    # In the command (a config may hold U+202E, not ESC), in the workload's output, in a process name.
    cmd = workload_cmd(tmp_path, "--say", "out\u202eput\\x1b[2J")
    d = daemon_factory(f"[gpu-all]\ngpus = ALL\n\n[process-miner]\ncmd = {cmd}\ngpus = 0\nuser = root\n")
    d.wait_running("miner")
    d.wait_log(r"starting miner.*out\\u202eput")
    d.wait_log(r"miner\[\d+\]: out.*put\\x1b\[2J")  # (workload.py's unescaping garbles the U+202E)
    holder = subprocess.Popen(
        [
            WORKLOAD_PYTHON,
            "-c",
            "import ctypes, sys, time; c = ctypes;"
            "c.CDLL(None).prctl(15, c.c_char_p(sys.argv[2].encode()), 0, 0, 0);"
            "f = open(sys.argv[1]); print(1, flush=True); time.sleep(60)",
            sim.device(1),
            "ev\u202eil\x1b",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline() == b"1\n"
        d.wait_log(r"GPU 1 .* busy: root ev\\u202eil\\x1b\[")
        status = subprocess.run(
            [*GPU_MON, "--config", str(d.config_path), "status"], capture_output=True, text=True, timeout=30
        ).stdout
        assert "ev\\u202eil\\x1b" in status
    finally:
        holder.kill()
        holder.wait()
    for text in (d.log(), status):
        assert "\u202e" not in text and "\x1b" not in text
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} gpu-mon\[", d.log(), re.M)


# ---------------------------------------------------------------------------------------- stop signals
# The daemon, the occupier and `gpu-mon sentinel` stop the same way on SIGTERM, SIGINT and SIGQUIT: one
# line naming the signal, everything they started stopped, exit 0 (`watch` passes the signal on and exits
# with its command's status: see test_watch.py).
STOPS = [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT]
STOP_IDS = ["TERM", "INT", "QUIT"]


@pytest.mark.parametrize("sig", STOPS, ids=STOP_IDS)
def test_the_daemon_names_the_signal_that_stops_it(tmp_path, sim, daemon_factory, sig):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    d.signal(sig)
    assert d.proc.wait(20) == 0
    assert not pid_alive(pid)
    assert re.findall(r"INFO stopping on (\S+): 1 workload\(s\) to stop$", d.log(), re.M) == [sig.name]


@pytest.mark.parametrize("sig", STOPS, ids=STOP_IDS)
def test_the_sentinel_stops_on_a_signal_with_one_line_and_exit_0(tmp_path, sim, sig):
    log_path = tmp_path / "sentinel.log"
    env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [*GPU_MON, "--sim", str(sim.path), "sentinel", "--interval", "0.1"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            wait_for(lambda: "a tick every 0.1 s" in log_path.read_text(), what="the sentinel's start line")
            proc.send_signal(sig)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert re.findall(r"INFO sentinel: stopping on (\S+)$", text, re.M) == [sig.name], text
    assert "Traceback" not in text


# Runs `gpu-mon occupy on ...` as a child subreaper, so that the detached occupier becomes its child when
# `on` exits, and prints the occupier's pid and then, when it ends, its exit status.
REAPER = """
import ctypes, os, re, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
on = subprocess.run(sys.argv[1:], capture_output=True, text=True)
pid = int(re.search(r"pid (\\d+)", on.stdout).group(1))
print(pid, flush=True)
_pid, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize("sig", STOPS, ids=STOP_IDS)
def test_the_occupier_stops_on_a_signal_like_the_daemon(tmp_path, sim, sig):
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_MON_SIM", "XDG_STATE_HOME")}
    env.update(GPU_MON_SIM=str(sim.path), XDG_STATE_HOME=str(tmp_path / "state"))
    occupy_log = tmp_path / "state" / "gpu-mon" / "occupy" / "occupy.log"
    cmd = [WORKLOAD_PYTHON, "-c", "import time; time.sleep(600)"]
    on = [*GPU_MON, "occupy", "on", "--wait-minutes", "0.01", "--refresh-minutes", "0.002", "--", *cmd]
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, *on], stdout=subprocess.PIPE, env=env, text=True)
    occupier = 0
    try:
        assert reaper.stdout is not None
        occupier = int(reaper.stdout.readline())
        workload = wait_for(
            lambda: [p.pid for p in psutil.Process(occupier).children(recursive=True)],
            what="the occupier running its command",
        )
        os.kill(occupier, sig)
        assert reaper.stdout.readline().strip() == "0"
        assert reaper.wait(20) == 0
        assert not [p for p in workload if pid_alive(p)]
    finally:
        if occupier and pid_alive(occupier):
            os.kill(occupier, signal.SIGKILL)
        reaper.kill()
        reaper.wait()
    text = occupy_log.read_text()
    assert re.findall(r"INFO stopping on (\S+): 1 workload\(s\) to stop$", text, re.M) == [sig.name], text
