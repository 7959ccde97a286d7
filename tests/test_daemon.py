"""End to end: `gpu-mon run` on simulated GPUs with real workloads, foreign processes and signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    UUIDS,
    WORKLOAD_PYTHON,
    idle_terminal,
    pid_alive,
    read_reports,
    tty_section,
    wait_for,
    workload_cmd,
)


def miner(tmp_path: Path, *args: str, gpus: str = "0", extra: str = "", user: str = "root") -> str:
    """A [process-miner] section running tests/workload.py as `user` (root by default: tmp_path is 0700)."""
    report = tmp_path / "report.jsonl"
    return (
        "[gpu-all]\ngpus = ALL\n\n[process-miner]\n"
        f"cmd = {workload_cmd(tmp_path, '--report', str(report), *args)}\n"
        f"gpus = {gpus}\nuser = {user}\n{extra}"
    )


def events(tmp_path: Path, kind: str) -> list:
    return [e for e in read_reports(tmp_path / "report.jsonl") if e["event"] == kind]


def started(tmp_path: Path, pid: int) -> dict:
    """Wait for the start report of workload process `pid`."""
    return wait_for(
        lambda: next((e for e in events(tmp_path, "start") if e["pid"] == pid), None),
        what=f"start report of {pid}",
    )


def gone(pids) -> bool:
    return not any(pid_alive(p) for p in pids)


def foreign_opener(path: str) -> subprocess.Popen:
    """A process that is not ours opening a GPU node and keeping it open (like any CUDA program)."""
    return subprocess.Popen(
        [
            WORKLOAD_PYTHON,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print('open', flush=True); time.sleep(600)",
            path,
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


@pytest.fixture
def opener_cleanup():
    procs = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_own_holders_never_preempt_and_foreign_opener_stops_whole_group(
    tmp_path, sim, daemon_factory, opener_cleanup
):
    # The workload and two grandchildren (one escaped with setsid) hold GPU 0's node: all ours.
    d = daemon_factory(miner(tmp_path, "--hold", sim.device(0), "--children", "1"))
    pid = d.wait_running("miner")
    children = wait_for(lambda: events(tmp_path, "child"), what="grandchild started")
    family = [pid] + [c["pid"] for c in children]

    # The daemon has seen the workload and its child holding GPU 0 (the state file is written in the round
    # that decides):
    # holding its own GPU is not "busy", so it kept running.
    def seen_all() -> bool:
        held = {h["pid"] for h in d.state().get("gpus", [{}])[0].get("holders", []) if h["ours"]}
        return held >= set(family)

    try:
        wait_for(seen_all, what="both holders seen as ours")
    except AssertionError:
        raise AssertionError(f"family {family}; state {d.state()}; log:\n{d.log()}") from None
    assert d.workload("miner")["state"] == "running"
    assert not [h for h in d.state()["gpus"][0]["holders"] if not h["ours"]]
    assert "stopping" not in d.log()
    # A foreign process opens GPU 0: the whole process group is stopped.
    p = foreign_opener(sim.device(0))
    opener_cleanup.append(p)
    assert p.stdout.readline() == b"open\n"
    d.wait_log(rf"busy: root python.*\[{p.pid}\] holds .*nvidia0; stopping miner")
    wait_for(lambda: gone(family), what="workload and its children gone")
    assert {e["pid"] for e in events(tmp_path, "term")} >= {pid}
    # Restart once the GPU is free again and the start delay has passed.
    p.kill()
    p.wait()
    d.wait_log(r"GPU 0 .* free$")
    second = d.wait_running("miner")
    assert second != pid
    assert d.stop() == 0


def test_escaped_grandchild_is_still_ours_and_is_stopped(tmp_path, sim, daemon_factory, opener_cleanup):
    d = daemon_factory(miner(tmp_path, "--hold", sim.device(0), "--children", "2", "--escape"))
    d.wait_running("miner")
    kids = wait_for(
        lambda: events(tmp_path, "child") if len(events(tmp_path, "child")) == 2 else None,
        what="two escaped children",
    )
    assert all(k["sid"] == k["pid"] for k in kids), "children should have their own sessions"
    p = foreign_opener(sim.device(0))
    opener_cleanup.append(p)
    d.wait_log(r"stopping miner")
    wait_for(lambda: gone([k["pid"] for k in kids]), what="escaped children gone")
    assert d.stop() == 0


def test_gpus_not_listed_never_get_the_workload(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path, gpus="1"))
    start = started(tmp_path, d.wait_running("miner"))
    assert start["env"]["CUDA_VISIBLE_DEVICES"] == UUIDS[1]
    assert start["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_unwatched_gpu_is_never_used(tmp_path, sim, daemon_factory):
    body = f"[gpu-one]\ngpus = 1\n[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = ALL\nuser = root\n"
    d = daemon_factory(body)
    d.wait_running("miner")
    uuids = d.workload("miner")["gpus"]
    assert uuids == [UUIDS[1]]


def test_per_gpu_instances_are_independent(tmp_path, sim, daemon_factory, opener_cleanup):
    d = daemon_factory(miner(tmp_path, gpus="ALL", extra="per_gpu = yes\n"))
    pid0, pid1 = d.wait_running("miner@0"), d.wait_running("miner@1")
    got = {started(tmp_path, p)["env"]["CUDA_VISIBLE_DEVICES"] for p in (pid0, pid1)}
    assert got == {UUIDS[0], UUIDS[1]}
    p = foreign_opener(sim.device(1))
    opener_cleanup.append(p)
    d.wait_log(r"stopping miner@1")
    wait_for(lambda: not pid_alive(pid1), what="miner@1 gone")
    assert pid_alive(pid0)
    assert d.workload("miner@0")["state"] == "running"


def test_multi_gpu_process_needs_all_and_stops_on_any(tmp_path, sim, daemon_factory, opener_cleanup):
    p = foreign_opener(sim.device(1))
    opener_cleanup.append(p)
    d = daemon_factory(miner(tmp_path, gpus="0,1"))
    d.wait_log(r"GPU 1 .* busy: root python")
    # GPU 0 alone is free, but the workload needs both.
    wait_for(lambda: "GPU 1" in d.workload("miner").get("why", ""), what="waiting for GPU 1")
    p.kill()
    p.wait()
    pid = d.wait_running("miner")
    assert started(tmp_path, pid)["env"]["CUDA_VISIBLE_DEVICES"] == f"{UUIDS[0]},{UUIDS[1]}"
    q = foreign_opener(sim.device(0))
    opener_cleanup.append(q)
    d.wait_log(r"GPU 0 .* busy: .*stopping miner")
    wait_for(lambda: not pid_alive(pid), what="miner gone")


def test_start_delay_and_gap_between_jobs(tmp_path, sim, daemon_factory, opener_cleanup):
    d = daemon_factory(miner(tmp_path), defaults={"start_delay_seconds": 2})
    d.wait_log(r"gpu-mon starting")
    wait_for(lambda: "start delay" in d.workload("miner").get("why", ""), what="start delay")
    line = d.wait_log(r"free for \d+ s; starting miner")[0]
    assert "free for 2 s" in line or "free for 3 s" in line


def test_terminal_user_pauses_everything_unless_whitelisted(tmp_path, sim, daemon_factory):
    term = idle_terminal(tmp_path, "7")  # nobody's terminal
    body = miner(tmp_path) + tty_section(term)
    d = daemon_factory(body)
    pid = d.wait_running("miner")
    now = time.time()
    os.utime(term, (now, now))  # nobody typed something
    d.wait_log(r"pausing all work: terminal user nobody at .*7")
    wait_for(lambda: not pid_alive(pid), what="workload stopped for the terminal user")
    # The state file is written at the end of the round that logged the line: wait for it.
    wait_for(lambda: "nobody" in "".join(d.state().get("paused_by", [])), what="paused_by in the state file")
    old = time.time() - 3600
    os.utime(term, (old, old))  # idle again
    d.wait_log(r"terminal users idle again")
    d.wait_running("miner")
    # Whitelisted: never pauses.
    d.write_config(body.replace("idle_seconds = 60", "idle_seconds = 60\nwhitelist = nobody"))
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded")
    os.utime(term, (time.time(), time.time()))
    wait_for(
        lambda: d.state().get("terminals") and d.state()["terminals"][0]["active_wall"] > time.time() - 5,
        what="look",
    )
    d.wait_log(r"reloaded")
    assert d.state()["paused_by"] == []
    assert d.workload("miner")["state"] == "running"


def test_crashing_command_backs_off_exponentially(tmp_path, sim, daemon_factory):
    d = daemon_factory(
        miner(tmp_path, "--exit-after", "0", "--code", "3"),
        defaults={"restart_delay_seconds": 0.3, "restart_delay_max_seconds": 2, "healthy_run_seconds": 30},
    )
    lines = d.wait_log(r"miner exited with status 3 .*restarting in", count=4, timeout=20)
    delays = [float(line.rsplit("restarting in ", 1)[1].split(" ")[0]) for line in lines[:4]]
    assert delays == [0.3, 0.6, 1.2, 2.0]
    assert "quick failures in a row" in lines[3]
    # The state file is written at the end of the round that logged the line: wait for it.
    wait_for(lambda: d.workload("miner").get("restarts", 0) >= 4, what="restart count in the state file")
    assert d.proc.poll() is None  # the daemon itself is fine


def test_command_that_does_not_exist(tmp_path, sim, daemon_factory):
    body = (
        "[gpu-all]\ngpus = ALL\n[process-ghost]\ncmd = /nonexistent/miner-run --fast\ngpus = 0\nuser = root\n"
    )
    d = daemon_factory(body)
    d.wait_log(r"ghost: cannot start: command '/nonexistent/miner-run': No such file")
    d.wait_log(r"ghost could not start \(command not found, status 127\).*restarting in")
    assert d.proc.poll() is None


def test_sighup_good_and_bad(tmp_path, sim, daemon_factory):
    body = miner(tmp_path) + f"\n[process-other]\ncmd = {workload_cmd(tmp_path)}\ngpus = 1\nuser = root\n"
    d = daemon_factory(body)
    miner_pid, other_pid = d.wait_running("miner"), d.wait_running("other")
    # A bad config: keep running on the old one, say why.
    d.write_config(body + "\n[process-broken]\ngpus = 0\n")
    d.signal(signal.SIGHUP)
    d.wait_log(r"reload: .*\[process-broken\] cmd: missing")
    d.wait_log(r"reload failed .* still running on the old config")
    assert pid_alive(miner_pid) and pid_alive(other_pid)
    # A good config that changes [process-miner] only: miner restarts, other keeps running.
    d.write_config(body.replace("gpus = 0\nuser = root", "gpus = 0\nuser = root\nenv = EXTRA=1", 1))
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded .*changed: \[process-miner\]")
    wait_for(lambda: not pid_alive(miner_pid), what="old miner gone")
    new_pid = d.wait_running("miner")
    assert new_pid != miner_pid
    assert started(tmp_path, new_pid)["env"]["EXTRA"] == "1"
    assert pid_alive(other_pid)
    assert d.wait_running("other") == other_pid


def test_sigterm_exits_0_and_leaves_nothing(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path, "--hold", sim.device(0), "--children", "2", "--escape"))
    pid = d.wait_running("miner")
    kids = wait_for(
        lambda: events(tmp_path, "child") if len(events(tmp_path, "child")) == 2 else None, what="children"
    )
    family = [pid] + [k["pid"] for k in kids] + d.descendants()
    assert d.stop() == 0
    wait_for(lambda: gone(family), timeout=5, what="every workload process gone after exit")
    assert not d.state_path.exists()


def test_sigterm_escalates_to_sigkill(tmp_path, sim, daemon_factory):
    d = daemon_factory(
        miner(tmp_path, "--ignore-term", "--children", "1"), defaults={"stop_timeout_seconds": 1}
    )
    pid = d.wait_running("miner")
    kid = wait_for(lambda: events(tmp_path, "child"), what="child")[0]["pid"]
    started = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - started < 8
    assert gone([pid, kid])
    assert "killing every process it started" in d.log()
    assert re.search(r"miner\[\d+\] stopped by SIGKILL after 1\.\d s", d.log())


def test_sigkill_of_the_daemon_leaves_nothing(tmp_path, sim, daemon_factory):
    d = daemon_factory(
        miner(tmp_path, "--hold", sim.device(0), "--children", "2", "--escape"),
        defaults={"stop_timeout_seconds": 1},
    )
    pid = d.wait_running("miner")
    kids = wait_for(
        lambda: events(tmp_path, "child") if len(events(tmp_path, "child")) == 2 else None, what="children"
    )
    family = d.descendants() + [pid] + [k["pid"] for k in kids]
    assert len(family) >= 4  # leader, command, two escaped children
    d.proc.kill()
    d.proc.wait()
    wait_for(lambda: gone(family), timeout=10, what="the leader taking every workload process down")


def test_runs_as_nobody_with_supplementary_groups_dropped(tmp_path, sim, daemon_factory, public_dir):
    report = public_dir / "report.jsonl"
    body = (
        "[gpu-all]\ngpus = ALL\n[process-miner]\n"
        f"cmd = {WORKLOAD_PYTHON} {public_dir / 'workload.py'} --report {report}\n"
        f"gpus = 0\ndir = {public_dir}\n"
    )
    groups = os.getgroups()
    os.setgroups([0, 44])  # the daemon itself has extra groups (video): the workload must not inherit them
    try:
        d = daemon_factory(body, env={"SECRET_OF_THE_DAEMON": "hunter2"})
    finally:
        os.setgroups(groups)
    d.wait_running("miner")
    start = wait_for(lambda: read_reports(report), what="report")[0]
    assert (start["uid"], start["euid"], start["gid"]) == (65534, 65534, 65534)
    assert start["groups"] == sorted(set(os.getgrouplist("nobody", 65534)))
    assert start["env"]["SECRET_OF_THE_DAEMON"] is None
    assert start["env"]["NOTIFY_SOCKET"] is None
    assert start["env"]["HOME"] == "/nonexistent" and start["env"]["USER"] == "nobody"
    assert start["env"]["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert start["stdin"] == "/dev/null"
    assert start["cwd"] == str(public_dir)


def test_nvml_only_foreign_process_makes_gpu_busy(tmp_path, sim, daemon_factory, opener_cleanup):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)
    opener_cleanup.append(stranger)
    sim.set(0, processes=[{"pid": stranger.pid, "used_memory_mib": 512}])
    d.wait_log(rf"root sleep\[{stranger.pid}\] has a compute context on it \(NVML, 512 MiB\); stopping miner")
    wait_for(lambda: not pid_alive(pid), what="miner stopped")
    # Our own workload listed by NVML does not count.
    sim.set(0, processes=[])
    pid = d.wait_running("miner")
    sim.set(0, processes=[{"pid": pid, "used_memory_mib": 70000}], memory_used_mib=70500)
    wait_for(lambda: d.state()["gpus"][0]["nvml_processes"], what="NVML view")
    assert d.workload("miner")["state"] == "running"
    # Memory used by something we cannot see as a process makes it busy.
    sim.set(0, memory_used_mib=72000)
    d.wait_log(r"2000 MiB used by others .*stopping miner")


@pytest.mark.parametrize(
    "breakage",
    [
        {"error": "GPU is lost"},
        {"memory_used_mib": None, "processes": None},
    ],
    ids=["gpu-lost", "fields-unreadable"],
)
def test_unreadable_gpu_is_busy(tmp_path, sim, daemon_factory, breakage):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    gpu = dict(sim.gpus[0])
    gpu.update(breakage)
    if "memory_used_mib" in breakage:
        gpu["memory_used_mib"] = None
        gpu["processes"] = None
    sim.gpus[0] = gpu
    sim.write()
    d.wait_log(r"GPU 0 .* busy: cannot be read: .*stopping miner")
    wait_for(lambda: not pid_alive(pid), what="stopped")


def test_broken_sim_file_makes_every_gpu_busy(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    sim.path.write_text("{not json")
    d.wait_log(r"GPUs cannot be read: .*not valid JSON.*stopping miner")
    wait_for(lambda: not pid_alive(pid), what="stopped")
    assert d.proc.poll() is None


def test_workload_output_is_tagged_and_cannot_forge_lines(tmp_path, sim, daemon_factory):
    # The workload prints an escape sequence, a carriage return and a newline-free fake daemon line.
    d = daemon_factory(miner(tmp_path, "--say", r"<0>EMERGENCY\x1b[31m fake\rgpu-mon[1] ERROR forged\x85x"))
    d.wait_running("miner")
    session = d.workload("miner")["pid"]  # lines are tagged with the workload's session id
    line = d.wait_log(rf"miner\[{session}\]: <0>EMERGENCY")[0]
    assert "\x1b" not in line and "\r" not in line and "\x85" not in line
    assert "\\x1b[31m fake\\x0dgpu-mon[1] ERROR forged\\x85x" in line
    assert line.index(" INFO ") < line.index("<0>")
    assert len([x for x in d.log().splitlines() if "forged" in x and "starting" not in x]) == 1


def test_log_file_gets_workload_output(tmp_path, sim, daemon_factory):
    log = tmp_path / "logs" / "miner.log"
    log.parent.mkdir()
    d = daemon_factory(miner(tmp_path, "--say", "hello log", extra=f"log = {log}\n"))
    d.wait_running("miner")
    wait_for(lambda: log.exists() and "hello log" in log.read_text(), what="output in the log file")
    assert oct(log.stat().st_mode & 0o777) == "0o640"
    assert not [x for x in d.log().splitlines() if "miner[" in x and ": hello log" in x]


def test_second_daemon_on_same_state_file_is_refused(tmp_path, sim, daemon_factory):
    d = daemon_factory(miner(tmp_path))
    d.wait_running("miner")
    from conftest import GPU_MON

    r = subprocess.run(
        [*GPU_MON, "--config", str(d.config_path), "--sim", str(sim.path), "run"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert "another gpu-mon daemon is running" in r.stderr
    assert d.proc.poll() is None


def test_exited_workload_still_listed_by_nvml_stays_ours(tmp_path, sim, daemon_factory):
    # NVML lists a process for a while after it exited (driver teardown): that must not look foreign.
    d = daemon_factory(miner(tmp_path))
    pid = d.wait_running("miner")
    sim.set(0, processes=[{"pid": pid, "used_memory_mib": 4000}], memory_used_mib=4000)
    wait_for(lambda: any(p["pid"] == pid for p in d.state()["gpus"][0]["nvml_processes"]), what="NVML view")
    d.write_config(d.body.replace("user = root", "user = root\nenv = EXTRA=2"))
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded .*changed: \[process-miner\]")
    wait_for(lambda: not pid_alive(pid), what="old workload gone")
    new = d.wait_running("miner")
    assert new != pid
    # The new workload runs and the daemon has looked at the dead pid that NVML still lists: ours.
    wait_for(
        lambda: (
            [p for p in d.state()["gpus"][0]["nvml_processes"] if p["pid"] == pid and p["ours"]]
            and d.workload("miner").get("command_pid") == new
        ),
        what="a round with the old pid still listed",
    )
    assert "not visible here" not in d.log() and "used by others" not in d.log()
    assert d.state()["gpus"][0]["busy"] is False


def test_workloads_start_when_the_daemon_runs_in_the_root_directory(tmp_path: Path, daemon_factory):
    # systemd starts the daemon in /. The leader's interpreter once found its standard library from a bare
    # argv[0] relative to the working directory: from / a pyenv or venv Python loaded /lib/python3.X
    # (another build's) and every leader died at import.
    d = daemon_factory(miner(tmp_path), cwd="/")
    pid = d.wait_running("miner")
    assert started(tmp_path, pid)["env"]["CUDA_VISIBLE_DEVICES"] == UUIDS[0]
