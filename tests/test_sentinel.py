"""`gpu-mon sentinel` and the daemon's [sentinel] on simulated GPUs whose utilization the test drives.

The command acts once per idle episode (end_process exits 0; command runs once; shutdown/reboot go through
`systemctl`, here a stand-in first on PATH that records its arguments), never with --dry-run, and never
while a GPU cannot be read. In the daemon, its own workloads are not activity.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import GPU_MON, SimHost, pid_alive, wait_for, workload_cmd

FAST = ["--arm-duration", "0.3", "--kill-duration", "0.5", "--interval", "0.1"]


class Sentinel:
    """A running `gpu-mon sentinel` with its log in a file."""

    def __init__(self, sim: SimHost, options: List[str], env=None):
        self.log_path = sim.dir / f"sentinel-{len(list(sim.dir.glob('sentinel-*.log')))}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        e = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
        e.update(env or {})
        self.proc = subprocess.Popen(
            [*GPU_MON, "--sim", str(sim.path), "sentinel", *options],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=e,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 20) -> None:
        rx = re.compile(pattern)
        try:
            wait_for(lambda: len(rx.findall(self.log())) >= count, timeout, f"/{pattern}/ x{count}")
        except AssertionError:
            raise AssertionError(f"no /{pattern}/ x{count} in:\n{self.log()}") from None

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def sentinels():
    made: List[Sentinel] = []
    yield made
    for s in made:
        s.stop()


def start(sentinels, sim, options, env=None) -> Sentinel:
    s = Sentinel(sim, options, env)
    sentinels.append(s)
    return s


def busy(sim: SimHost, pct: int) -> None:
    for i in range(len(sim.gpus)):
        sim.set(i, utilization_pct=pct)


def test_end_process_arms_on_activity_and_exits_0_when_idle(sim, sentinels):
    busy(sim, 0)
    s = start(sentinels, sim, FAST)
    s.wait_log("a tick every 0.1 s")
    busy(sim, 90)
    s.wait_log("armed after 0.3 s at >= 70%")
    assert s.proc.poll() is None
    busy(sim, 5)
    assert s.wait() == 0
    log = s.log()
    assert log.count("armed after") == 1 and "idle 0.5 s below 10%: ending" in log


def ticks(s: Sentinel) -> int:
    return s.log().count(" DEBUG usage: ")


def wait_ticks(s: Sentinel, more: int) -> None:
    """Wait until the sentinel has ticked `more` more times (each tick logs its usage with --debug)."""
    target = ticks(s) + more
    wait_for(lambda: ticks(s) >= target, what=f"{more} more ticks", timeout=30)


def test_never_acts_before_it_was_armed(sim, sentinels):
    busy(sim, 0)
    s = start(sentinels, sim, [*FAST, "--debug"])
    wait_ticks(s, 20)  # idle 4 kill durations long, but never armed
    assert s.proc.poll() is None and "armed" not in s.log()


def test_command_runs_once_per_idle_episode(sim, sentinels, tmp_path: Path):
    out = tmp_path / "fired"
    cmd = f"{sys.executable} -c \"open('{out}', 'a').write('x')\""
    busy(sim, 90)
    s = start(sentinels, sim, [*FAST, "--debug", "--kill-action", "command", "--command", cmd])
    s.wait_log("armed after")
    busy(sim, 0)
    s.wait_log("waiting to arm again")
    assert out.read_text() == "x"
    wait_ticks(s, 20)  # four more kill durations of idleness: nothing (the seed fired on every tick)
    assert out.read_text() == "x"
    busy(sim, 90)
    s.wait_log("armed after", count=2)
    busy(sim, 0)
    s.wait_log("waiting to arm again", count=2)
    assert out.read_text() == "xx"
    assert s.proc.poll() is None


def test_dry_run_never_acts(sim, sentinels, tmp_path: Path):
    out = tmp_path / "fired"
    busy(sim, 90)
    s = start(sentinels, sim, [*FAST, "--dry-run", "--kill-action", "command", "--command", f"touch {out}"])
    s.wait_log("armed after")
    busy(sim, 0)
    s.wait_log(r"idle 0.5 s below 10%: running: touch .* \(dry run: not done\)")
    busy(sim, 90)
    s.wait_log("armed after", count=2)
    assert not out.exists() and s.proc.poll() is None


def test_unreadable_gpu_counts_as_active(sim, sentinels):
    busy(sim, 90)
    s = start(sentinels, sim, [*FAST, "--debug"])
    s.wait_log("armed after")
    sim.set(1, error="GPU is lost")
    busy_before = ticks(s)
    sim.set(0, utilization_pct=0)
    s.wait_log("cannot read GPU use .*GPU is lost.*: counting as active")
    wait_ticks(s, 20)
    assert s.proc.poll() is None and ticks(s) > busy_before
    (sim.dir / "sim.json").write_text("{")  # the whole backend unreadable: the same
    wait_ticks(s, 10)
    assert s.proc.poll() is None
    sim.set(1, error=None, utilization_pct=0)  # readable and idle again: it was armed all along
    s.wait_log("GPU use readable again")
    assert s.wait() == 0


def test_aggregate_max_keeps_the_machine_up_while_one_gpu_is_busy(sim, sentinels):
    busy(sim, 90)
    mean = start(sentinels, sim, [*FAST, "--aggregate", "mean"])
    high = start(sentinels, sim, [*FAST, "--aggregate", "max", "--debug"])
    for s in (mean, high):
        s.wait_log("armed after")
    sim.set(0, utilization_pct=0)
    sim.set(1, utilization_pct=15)  # mean 7.5% is idle (< 10%), max 15% is not
    assert mean.wait() == 0
    wait_ticks(high, 20)
    assert high.proc.poll() is None


def test_gpu_devices_choose_the_gpus(sim, sentinels):
    sim.set(0, utilization_pct=0)
    sim.set(1, utilization_pct=90)
    s = start(sentinels, sim, [*FAST, "--gpu_devices", "1", "--kill_threshold", "0.5"])
    s.wait_log("armed after")
    sim.set(1, utilization_pct=10)
    assert s.wait() == 0


@pytest.mark.parametrize("action, verb", [("shutdown", "poweroff"), ("reboot", "reboot")])
def test_shutdown_and_reboot_go_through_systemctl(sim, sentinels, tmp_path: Path, action, verb):
    bin_dir, calls = fake_systemctl(tmp_path, status=0)
    busy(sim, 90)
    s = start(
        sentinels, sim, [*FAST, "--kill-action", action], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    s.wait_log("armed after")
    busy(sim, 0)
    s.wait_log(f"systemctl {verb} done")
    assert calls.read_text().split() == [verb]
    assert s.proc.poll() is None  # it goes on (the machine is going down anyway)


def test_a_failed_action_exits_1_with_the_reason(sim, sentinels, tmp_path: Path):
    bin_dir, _calls = fake_systemctl(
        tmp_path, status=1, say="Failed to power off system via logind: Access denied"
    )
    busy(sim, 90)
    s = start(
        sentinels, sim, [*FAST, "--kill-action", "shutdown"], env={"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    )
    s.wait_log("armed after")
    busy(sim, 0)
    assert s.wait() == 1
    assert (
        "systemctl poweroff failed (exit 1): Failed to power off system via logind: Access denied" in s.log()
    )
    assert "Traceback" not in s.log()


def test_dry_run_never_calls_systemctl(sim, sentinels, tmp_path: Path):
    bin_dir, calls = fake_systemctl(tmp_path, status=0)
    busy(sim, 90)
    options = [*FAST, "--kill-action", "shutdown", "--dry-run"]
    s = start(sentinels, sim, options, env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    s.wait_log("armed after")
    busy(sim, 0)
    s.wait_log(r"shutting down \(dry run: not done\)")
    assert not calls.exists()


def fake_systemctl(tmp_path: Path, status: int, say: str = ""):
    """A `systemctl` first on PATH that records its arguments (never the real one: tests run as root)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl.calls"
    script = bin_dir / "systemctl"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho '{say}' >&2\nexit {status}\n")
    script.chmod(0o755)
    return bin_dir, calls


@pytest.mark.parametrize(
    "options, message",
    [
        (["--arm-threshold", "1.5"], "'1.5' is not a fraction from 0 to 1"),
        (["--kill_threshold", "x"], "'x' is not a number from 0 to 1"),
        (["--kill-action", "command"], "--kill-action command needs --command CMD"),
        (["--command", "true"], "--command is only used with --kill-action command"),
        (["--interval", "0"], "--interval must be at least 0.1 s"),
        (["--kill-duration", "-1"], "--kill-duration must be a number of seconds >= 0"),
        (["--gpu-devices", "0,,1"], "empty item in the list"),
        (["--kill-action", "explode"], "invalid choice: 'explode'"),
        (["--command", "'unclosed", "--kill-action", "command"], "No closing quotation"),
    ],
)
def test_bad_usage_exits_2_with_one_line(sim, options, message):
    r = subprocess.run(
        [*GPU_MON, "--sim", str(sim.path), "sentinel", *options], capture_output=True, text=True
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_gpu_that_does_not_exist_is_unreadable_not_idle(sim, sentinels):
    busy(sim, 90)
    s = start(sentinels, sim, [*FAST, "--gpu-devices", "0,5"])
    s.wait_log(r"cannot read GPU use \(no GPU 5 .*\): counting as active")
    assert s.proc.poll() is None and "armed" not in s.log()


# ---------------------------------------------------------------------------------------------------------
# [sentinel] in the daemon


def test_daemon_sentinel_ignores_its_own_workloads(tmp_path: Path, sim, daemon_factory):
    fired = tmp_path / "fired"
    body = (
        "[gpu-all]\ngpus = ALL\n\n[process-w]\n"
        f"cmd = {workload_cmd(tmp_path)}\ngpus = 0\nuser = root\n\n"
        "[sentinel]\narm_duration_seconds = 0.4\nkill_duration_seconds = 1\naggregate = max\n"
        f"kill_action = command\ncommand = {sys.executable} -c \"open('{fired}', 'a').write('x')\"\n"
    )
    d = daemon_factory(body, defaults={"interval_seconds": 0.1}, args=("--debug",))
    pid = d.wait_running("w")
    # Our workload computes at 100%: that is not activity, so nothing arms.
    sim.set(0, utilization_pct=100, processes=[{"pid": pid, "used_memory_mib": 500, "utilization_pct": 100}])
    d.wait_log("sentinel: usage by others 0%", count=20)
    assert "armed" not in d.log()
    foreign = subprocess.Popen(["sleep", "600"])
    try:
        # Someone else computes on GPU 1 (NVML lists their process): activity. It arms.
        procs = [{"pid": foreign.pid, "used_memory_mib": 900, "utilization_pct": 80}]
        sim.set(1, utilization_pct=80, processes=procs)
        d.wait_log("sentinel: armed after 0.4 s")
        sim.set(1, utilization_pct=0, processes=[])
    finally:
        foreign.kill()
        foreign.wait()
    # They left; our workload still computes on GPU 0 at 100%: the machine is idle for everyone else.
    d.wait_log(r"sentinel: idle 1 s below 10%: running: ")
    d.wait_log("sentinel: .* done")
    assert fired.read_text() == "x"
    assert d.proc.poll() is None and d.wait_running("w") == pid  # the daemon and its workload go on


def test_daemon_sentinel_end_process_stops_the_daemon(tmp_path: Path, sim, daemon_factory):
    body = (
        "[gpu-all]\ngpus = ALL\n\n[process-w]\n"
        f"cmd = {workload_cmd(tmp_path)}\ngpus = 0\nuser = root\n\n"
        "[sentinel]\narm_duration_seconds = 0\nkill_duration_seconds = 0.5\n"
    )
    sim.set(1, utilization_pct=90)  # GPU 1 is busy (no per-process samples, not ours): active
    d = daemon_factory(body, defaults={"interval_seconds": 0.1})
    pid = d.wait_running("w")
    sim.set(1, utilization_pct=0)
    assert d.proc.wait(20) == 0
    assert "sentinel: stopping gpu-mon (kill_action = end_process)" in d.log()
    assert not pid_alive(pid)


def test_check_reports_a_sentinel_gpu_that_is_not_there(tmp_path: Path, sim):
    from conftest import write_config

    conf = write_config(tmp_path / "c.conf", "[gpu-all]\ngpus = ALL\n\n[sentinel]\ngpus = 0, 5\n")
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "check"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert f"{conf}:5: [sentinel] gpus: no GPU with index 5 (this host has 2)" in r.stderr
