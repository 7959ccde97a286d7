"""Queued jobs under a real systemd (tests/nspawn.py, as test_under_systemd.py boots it, with the shipped
gpu-mon.service): each job runs as a transient service unit of its own, outside the service's sandbox. A user
made in the container submits with `gpu-mon submit` (the checkout's package, the system's Python, as that
user); the job writes the user's home and the container's real /tmp, is stopped through its unit's group
when someone else opens its GPU (with every process it started), and is stopped by systemd when gpu-mon is
killed, the restarted daemon requeueing it once.

Outside the container (no systemd as PID 1 here) the direct path is chosen: tests/test_queue.py covers it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import psutil
import pytest
import test_under_systemd as under
from conftest import wait_for
from test_under_systemd import CHECKOUT, OPENER, SIM, SRV, UNIT, Service, _gpu_mon, _write_config

from gpu_mon.engine.workloads import transient

box, host = under.box, under.host  # this module's fixtures too: a container of its own
USER = "gmqsys"
CLIENT_CONF = "/etc/gpu-mon-client.conf"
DATABASE = "/var/lib/gpu_mon/queue.sqlite"
CONFIG = """\
[defaults]
start_delay_seconds = 0
interval_seconds = 10

[gpu-all]
gpus = ALL

[queue]
grace_seconds = 3
"""
# A job: notes who and where it is (its cgroup, its GPU, its argv) in its home, written last, and writes the
# machine's /tmp. `stubborn` holds its GPU's device node open and on its first run leaves a double-forked
# child (holding it too) that ignores SIGTERM and runs until killed; after a restart it ends after a second.
# `exit N`: exits N; `term`: SIGTERM ends it.
QJOB = r"""
import json, os, signal, sys, time
env = os.environ
restart = int(env["GPU_MON_RESTART_COUNT"])
tag = env["GPU_MON_JOB_ID"] + "-" + str(restart)
with open("/tmp/qjob-" + tag, "w") as f:
    f.write("tmp")
info = {"uid": os.getuid(), "cgroup": open("/proc/self/cgroup").read().strip(), "cwd": os.getcwd(),
        "cuda": env.get("CUDA_VISIBLE_DEVICES"), "argv": sys.argv[1:], "pid": os.getpid(),
        "env": {k: v for k, v in env.items() if k.startswith("QT_")}}
mode = sys.argv[1]
if mode == "stubborn":  # it uses its GPU: holds its device node open (so does its child)
    sim = json.load(open("/srv/gpu-mon-test/sim.json"))
    node = next(g["device"] for g in sim["gpus"] if g["uuid"] == env["CUDA_VISIBLE_DEVICES"])
    held = open(os.path.join("/srv/gpu-mon-test", node))
if mode == "stubborn" and restart == 0:
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.write(w, str(os.getpid()).encode())
            while True:
                time.sleep(0.1)
        os._exit(0)
    os.close(w)
    info["child"] = int(os.read(r, 32))
if mode == "probe":  # opens every GPU's node: what each open gave
    import errno
    sim = json.load(open("/srv/gpu-mon-test/sim.json"))
    info["probes"] = {}
    for g in sim["gpus"]:
        try:
            os.close(os.open(os.path.join("/srv/gpu-mon-test", g["device"]), os.O_RDWR))
            info["probes"][g["uuid"]] = "opened"
        except OSError as e:
            info["probes"][g["uuid"]] = errno.errorcode.get(e.errno, str(e.errno))
path = os.path.join(env["HOME"], "qjob-" + tag + ".json")
with open(path + ".new", "w") as f:
    json.dump(info, f)
os.rename(path + ".new", path)
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "probe":
    sys.exit(0)
if mode == "term":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "stubborn" and restart >= 1:
    time.sleep(1)
    sys.exit(0)
if mode == "until":  # until a file is there, then exit CODE; each SIGTERM or SIGUSR1 noted, TERM ends it
    linger = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # (after TERM: a checkpoint that takes time)
    def noted(signum, frame):
        with open(os.path.join(env["HOME"], "qjob-" + tag + ".signals"), "a") as f:
            f.write(signal.Signals(signum).name + "\n")
        if signum == signal.SIGTERM:
            time.sleep(linger)
            sys.exit(143)
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, noted)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    sys.exit(int(sys.argv[3]))
while True:
    time.sleep(0.1)
"""


class Lab:
    """gpu-mon.service with a [queue], and a user of the container who submits."""

    def __init__(self, service: Service, uid: int):
        self.svc = service
        self.box = service.box
        self.uid = uid

    def submit(self, *command: str, options: Tuple[str, ...] = (), extra: Tuple[str, ...] = ()) -> int:
        """`gpu-mon submit` as the user, from the user's home, with the system's Python (`extra`: more
        NAME=VALUE in its environment)."""
        env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME=/home/{USER}", f"USER={USER}", "LANG=C.UTF-8"]
        env += [f"PYTHONPATH={CHECKOUT}", *extra]
        client = ["/usr/bin/python3", "-m", "gpu_mon", "--config", CLIENT_CONF, "submit", "--json", *options]
        client += ["--"]
        argv = ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--init-groups", *env]
        argv += ["sh", "-c", 'cd "$HOME" && exec "$@"', "sh", *client, "/usr/bin/python3", f"{SRV}/qjob.py"]
        out = self.box.run([*argv, *command]).stdout
        return int(json.loads(out)["id"])

    def job(self, job_id: int) -> dict:
        out = self.box.run([_gpu_mon(), "--config", CLIENT_CONF, "jobs", "--json", "--all"]).stdout
        return next(j for j in json.loads(out)["jobs"] if j["id"] == job_id)

    def runs(self, job_id: int) -> list:
        """The job's runs as `gpu-mon show --json` gives them (the store's records)."""
        out = self.box.run([_gpu_mon(), "--config", CLIENT_CONF, "show", "--json", str(job_id)]).stdout
        return json.loads(out)["jobs"][0]["runs"]

    def wait_job(self, job_id: int, state: str, restarts: int = 0, timeout: float = 30) -> dict:
        def reached():
            j = self.job(job_id)
            return j if (j["state"], j["restarts"]) == (state, restarts) else None

        return wait_for(reached, timeout, f"job {job_id} {state} (restart {restarts})", interval=0.1)

    def home(self, name: str) -> Path:
        return self.box.path(f"/home/{USER}/{name}")

    def report(self, job_id: int, restart: int) -> dict:
        path = self.home(f"qjob-{job_id}-{restart}.json")
        wait_for(path.exists, 20, f"{path.name} written by the job")
        return json.loads(path.read_text())

    def log(self, job_id: int) -> Path:
        """The job's default output."""
        return self.home(f".local/state/gpu-mon/jobs/{job_id}.log")

    def alive(self, pid: int) -> bool:
        """Whether a process of the container (its own pid) runs (a zombie does not)."""
        try:
            stat = self.box.path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")

    def unit_lines(self, unit: str) -> List[tuple]:
        return self.box.journal(unit, self.svc.since)


def _user(box) -> int:
    if box.run(["id", "-u", USER], check=False).returncode != 0:
        box.run(["useradd", "-m", "-s", "/bin/sh", USER])
    return int(box.run(["id", "-u", USER]).stdout)


@pytest.fixture
def lab(box, host) -> Iterator[Lab]:
    """gpu-mon with CONFIG, an empty queue and the user; afterwards every job's unit stopped and the
    user's and the jobs' files removed."""
    (host.dir / "qjob.py").write_text(QJOB)
    box.write(CLIENT_CONF, "[queue]\n")
    uid = _user(box)
    _write_config(box, CONFIG)
    svc = Service(box, host)
    svc.systemctl("start", UNIT)
    try:
        yield Lab(svc, uid)
    finally:
        svc.systemctl("stop", UNIT, check=False)
        svc.systemctl("reset-failed", UNIT, check=False)
        units = ["gpu-mon-job-*.service", "gpu-mon-hook-*.service", "gpu-mon-note-*.service"]
        box.run(["systemctl", "stop", *units], check=False)
        box.run(["systemctl", "reset-failed", *units], check=False)
        box.run(["sh", "-c", f"rm -rf {DATABASE}* /tmp/qjob-* /home/{USER}/qjob-* /home/{USER}/.local"])


def _device_of(lab: Lab, uuid: Optional[str]) -> str:
    index = next(i for i in range(3) if lab.svc.host.uuid(i) == uuid)
    return f"{SRV}/dev/nvidia{index}"


def test_a_job_runs_as_its_user_in_a_unit_of_its_own_outside_the_sandbox(lab: Lab):
    lab.svc.wait_line(r"^queue: jobs run as transient units in gpu_mon_jobs\.slice; they outlive gpu-mon")
    # systemd would expand $NAME in a unit's command line and %n nowhere: the job gets its arguments as given
    job = lab.submit("exit", "0", "$HOME ${USER} $$ %n")
    done = lab.wait_job(job, "done")
    assert done["exit_status"] == 0
    info = lab.report(job, 0)
    assert info["uid"] == lab.uid and info["cwd"] == f"/home/{USER}"
    assert info["argv"] == ["exit", "0", "$HOME ${USER} $$ %n"], info["argv"]
    group = f"0::/gpu_mon_jobs.slice/gpu-mon-job-{job}-r0.service"
    assert group in info["cgroup"].splitlines(), info["cgroup"]
    # The user's home and the machine's /tmp (not the service's private one), written as the user.
    for path in (lab.home(f"qjob-{job}-0.json"), lab.box.path(f"/tmp/qjob-{job}-0")):
        assert path.stat().st_uid == lab.uid, path
    log = lab.home(f".local/state/gpu-mon/jobs/{job}.log")
    assert log.exists() and log.stat().st_uid == lab.uid
    # Its own exit status, also where systemd-run's would say otherwise (0 for SIGTERM, 255 for a signal).
    failed = lab.submit("exit", "3")
    assert lab.wait_job(failed, "failed")["exit_status"] == 3
    termed = lab.submit("term")
    assert lab.wait_job(termed, "failed")["exit_status"] == 128 + 15
    lab.svc.wait_line(rf"^queue: job {termed} of {USER} was killed by signal 15: failed$")
    warnings = [line for _t, line in lab.svc.lines(priority="warning") if "[process-*]" not in line]
    assert not warnings, warnings


def test_a_foreign_open_stops_every_process_of_the_job_which_runs_again(lab: Lab):
    job = lab.submit("stubborn")
    info = lab.report(job, 0)
    unit = f"gpu-mon-job-{job}-r0.service"
    assert lab.alive(info["child"]) and lab.alive(info["pid"])
    foreign = "gpu-mon-test-foreign.service"
    device = _device_of(lab, info["cuda"])
    lab.box.run(["systemd-run", "--collect", f"--unit={foreign}", "/usr/bin/python3", "-c", OPENER, device])
    try:
        began = time.monotonic()
        _t, opened = lab.svc.wait_line(r"^opened at ([\d.]+)$", unit=foreign)
        stopping, _m = lab.svc.wait_line(rf"busy: root python3\[\d+\] holds {device}; stopping job {job}$")
        # (the line is written just after the stop signal went to every process in the job's unit)
        latency = stopping - float(opened.group(1))
        print(f"foreign open to the job's stop signal: {latency * 1000:.0f} ms (journal time)")
        assert latency < 5.0, f"{latency:.3f} s from the open to the stop"
        # The child ignores SIGTERM and left the job's session: the unit's group reaches it after the grace.
        kill = rf"^job {job}\[\d+\] still running 3\.\d s after SIGTERM; killing every process of {unit}"
        lab.svc.wait_line(kill)
        wait_for(
            lambda: not lab.alive(info["child"]) and not lab.alive(info["pid"]),
            10,
            "the job's processes gone",
        )
        took = time.monotonic() - began
        assert took < 3 + 5, f"{took:.1f} s from the open to the last process gone"
        again = lab.wait_job(job, "done", restarts=1)
    finally:
        lab.box.run(["systemctl", "stop", foreign], check=False)
    assert again["exit_status"] == 0
    # Its own opens of its GPU (the command's, and its child's outside its session) were never someone else's.
    stops = [line for _t, line in lab.svc.lines() if "; stopping job" in line]
    assert len(stops) == 1 and " root python3[" in stops[0], stops
    rerun = lab.report(job, 1)
    assert rerun["cgroup"].endswith(f"/gpu-mon-job-{job}-r1.service") and rerun["cuda"] != info["cuda"]
    assert lab.box.show(unit, "ActiveState")["ActiveState"] == "inactive"
    # The line in the job's log (0600, in the user's home: written as the user, outside gpu-mon's sandbox)
    said = rf"^gpu-mon: job {job} preempted at [\d:]+: .*busy: root python3\[\d+\] holds {device}; requeued"
    wait_for(lambda: re.search(said, lab.log(job).read_text(), re.M), 10, "the preemption's line in the log")


# A hook: its line goes to the job's log; it writes the user's home and the machine's /tmp (written last).
HOOK = (
    'echo "hook $GPU_MON_JOB_ID $GPU_MON_JOB_STATE $GPU_MON_JOB_EXIT"; id -u >"$HOME/qjob-hook-uid"; '
    'cat /proc/self/cgroup >"$HOME/qjob-hook-cgroup"; echo x >/tmp/qjob-hook'
)
# A hook that ignores SIGTERM (so does its sleep: an ignored signal stays ignored across exec).
STUBBORN_HOOK = "trap '' TERM; echo $$ >\"$HOME/qjob-hook-pid\"; exec sleep 600"


def test_a_hook_runs_as_its_user_in_a_unit_outside_the_sandbox_its_output_in_the_log(lab: Lab):
    job = lab.submit("exit", "3", options=("--notify", HOOK))
    assert lab.wait_job(job, "failed")["exit_status"] == 3
    done = lab.box.path("/tmp/qjob-hook")
    wait_for(lambda: done.exists() and done.read_text() == "x\n", 20, "the hook's file in the machine's /tmp")
    assert done.stat().st_uid == lab.uid
    uid = lab.home("qjob-hook-uid")
    assert uid.read_text() == f"{lab.uid}\n" and uid.stat().st_uid == lab.uid
    unit = rf"^0::/gpu_mon_jobs\.slice/gpu-mon-hook-{job}-\d+-\d+\.service$"
    cgroup = lab.home("qjob-hook-cgroup").read_text()
    assert re.search(unit, cgroup, re.M), cgroup
    text = lab.log(job).read_text()
    assert f"\nhook {job} failed 3\n" in f"\n{text}", text
    assert lab.log(job).stat().st_uid == lab.uid


def test_a_hook_still_running_when_gpu_mon_stops_ends_with_it(lab: Lab):
    job = lab.submit("exit", "0", options=("--notify", STUBBORN_HOOK))
    pidfile = lab.home("qjob-hook-pid")
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the hook's pid"))
    assert lab.alive(pid)
    lab.svc.systemctl("stop", UNIT)  # (gpu-mon gives it 2 s, then SIGTERM to its unit, then SIGKILL)
    wait_for(lambda: not lab.alive(pid), 5, "the hook gone with gpu-mon")
    lab.svc.wait_line(rf"^queue: job {job}: its hook was still running when gpu-mon stopped: killed$")
    said = f"gpu-mon: job {job}: its hook was still running when gpu-mon stopped: killed\n"
    wait_for(lambda: said in lab.log(job).read_text(), 10, "the hook's end in the job's log")
    listing = ["systemctl", "list-units", "--all", "--plain", "--no-legend", "gpu-mon-hook-*"]
    hooks = lab.box.run(listing).stdout
    assert "active" not in hooks.replace("inactive", ""), hooks


# A hook that leaves a child in a session of its own, its pid in the user's home, and exits.
ESCAPING_HOOK = (
    "setsid sh -c 'echo $$ >\"$HOME/qjob-hook-orphan\"; exec sleep 600' </dev/null >/dev/null 2>&1 & "
    'while [ ! -s "$HOME/qjob-hook-orphan" ]; do sleep 0.05; done'
)


def test_a_child_a_hook_setsid_ends_with_the_hooks_unit_when_the_hook_exits(lab: Lab):
    job = lab.submit("exit", "0", options=("--notify", ESCAPING_HOOK))
    pidfile = lab.home("qjob-hook-orphan")
    pid = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the orphan"))
    # systemd stops the unit when its main process exits (KillMode=control-group): SIGTERM to what is left
    wait_for(lambda: not lab.alive(pid), 10, "the hook's child gone with the hook")
    listing = ["systemctl", "list-units", "--all", "--plain", "--no-legend", f"gpu-mon-hook-{job}-*"]
    hooks = lab.box.run(listing).stdout
    assert "active" not in hooks.replace("inactive", ""), hooks


def _taken_over(lab: Lab, job: int, after: float) -> None:
    unit = f"gpu-mon-job-{job}-r0.service"
    lab.svc.wait_line(
        rf"^queue: job {job} of {USER} found running in {unit}: taken over \(restart 0\)$", after=after
    )
    said = rf"^gpu-mon: job {job} found running at [\d:]+ by a gpu-mon that started again; it runs on$"
    wait_for(lambda: re.search(said, lab.log(job).read_text(), re.M), 10, "the takeover's line in the log")


def _guard_armed(lab: Lab) -> bool:
    state = lab.box.run(["systemctl", "is-active", "gpu-mon-unguarded.timer"], check=False).stdout.strip()
    return state == "active"


def test_a_restart_of_gpu_mon_leaves_its_running_job_untouched_and_takes_it_over(lab: Lab):
    flag = f"/home/{USER}/qjob-go"
    job = lab.submit("until", flag, "3")
    info = lab.report(job, 0)
    before = time.time()
    lab.svc.systemctl("restart", UNIT)
    _taken_over(lab, job, before)
    lab.svc.wait_line(r"^queue: 1 job\(s\) left running in their units: 1$", after=before)
    # No signal, the same process, the same run; the guard the old daemon's leader armed is disarmed.
    assert lab.alive(info["pid"]) and not lab.home(f"qjob-{job}-0.signals").exists()
    running = lab.job(job)
    assert (running["state"], running["restarts"]) == ("running", 0)
    wait_for(lambda: not _guard_armed(lab), 10, "the guard disarmed")
    # Its end, once, with its own status: recorded by systemd, seen through the new client.
    lab.box.run(["touch", flag])
    failed = lab.wait_job(job, "failed")
    assert failed["exit_status"] == 3
    lab.svc.wait_line(rf"^queue: job {job} of {USER} exited with status 3: failed$", after=before)
    assert not lab.unit_lines(f"gpu-mon-job-{job}-r1.service"), "the job ran a second time"
    assert not list(lab.box.path("/var/lib/gpu_mon").glob("gpu-mon-job-*"))  # (its record taken)
    (run,) = lab.runs(job)  # one run in the store's records, across both daemons, ended as it did
    assert (run["restart"], run["how"], run["end"] is not None) == (0, "failed", True), run


def test_a_job_taken_over_keeps_its_time_limit_counted_from_its_start(lab: Lab):
    flag = f"/home/{USER}/qjob-go"
    job = lab.submit("until", flag, "0", options=("--time-limit", "6"))
    info = lab.report(job, 0)
    before = time.time()
    lab.svc.systemctl("restart", UNIT)
    _taken_over(lab, job, before)
    ended = lab.wait_job(job, "timeout")
    assert ended["restarts"] == 0 and lab.home(f"qjob-{job}-0.signals").read_text() == "SIGTERM\n"
    at = lambda k: datetime.datetime.strptime(ended[k], "%Y-%m-%dT%H:%M:%S%z").timestamp()  # noqa: E731
    ran = at("ended") - at("started")  # (whole seconds)
    assert 5 <= ran <= 6 + 4, ran  # from its start under the old gpu-mon, not from the takeover
    assert not lab.alive(info["pid"])


def test_a_killed_daemon_leaves_its_job_running_and_the_next_one_yields_it(lab: Lab):
    job = lab.submit("stubborn")
    info = lab.report(job, 0)
    killed = time.time()
    lab.svc.systemctl("kill", "--signal=SIGKILL", "--kill-whom=main", UNIT)
    wait_for(lambda: _guard_armed(lab), 10, "the guard armed by the job's leader as gpu-mon died")
    _taken_over(lab, job, killed)
    assert lab.alive(info["pid"]) and lab.alive(info["child"])
    wait_for(lambda: not _guard_armed(lab), 10, "the guard disarmed")
    # Someone opens its GPU: the new gpu-mon stops every process of the unit, and the job runs again.
    foreign = "gpu-mon-test-foreign.service"
    device = _device_of(lab, info["cuda"])
    lab.box.run(["systemd-run", "--collect", f"--unit={foreign}", "/usr/bin/python3", "-c", OPENER, device])
    try:
        _t, opened = lab.svc.wait_line(r"^opened at ([\d.]+)$", unit=foreign)
        stopping, _m = lab.svc.wait_line(rf"busy: root python3\[\d+\] holds {device}; stopping job {job}$")
        assert stopping - float(opened.group(1)) < 5.0
        gone = lambda: not lab.alive(info["child"]) and not lab.alive(info["pid"])  # noqa: E731
        wait_for(gone, 3 + 5, "the job's processes gone")
        again = lab.wait_job(job, "done", restarts=1)
    finally:
        lab.box.run(["systemctl", "stop", foreign], check=False)
    assert again["exit_status"] == 0
    assert not lab.unit_lines(f"gpu-mon-job-{job}-r2.service"), "the job ran a third time"


def test_a_job_that_ends_while_gpu_mon_hangs_and_the_watchdog_kills_it_runs_once(lab: Lab):
    """The issue's case: gpu-mon hangs (SIGSTOP), the job exits 3 meanwhile, the watchdog kills gpu-mon,
    systemd removes /run/gpu_mon... and starts it again: the job ends failed with its 3, never runs again."""
    lab.box.write(f"{under.DROP_INS}/test-watchdog.conf", "[Service]\nWatchdogSec=2s\nTimeoutAbortSec=2s\n")
    try:
        lab.svc.systemctl("daemon-reload")
        lab.svc.systemctl("restart", UNIT)
        flag = f"/home/{USER}/qjob-go"
        job = lab.submit("until", flag, "3")
        lab.report(job, 0)
        hung = time.time()
        lab.svc.systemctl("kill", "--signal=SIGSTOP", "--kill-whom=main", UNIT)
        lab.box.run(["touch", flag])
        lab.svc.wait_line(r"Watchdog timeout \(limit 2s\)!", after=hung)
        said = rf"^queue: job {job} exited with status 3 while gpu-mon was not there to see it: failed$"
        lab.svc.wait_line(said, after=hung, timeout=60)
        failed = lab.wait_job(job, "failed")
    finally:
        lab.box.run(["rm", "-f", f"{under.DROP_INS}/test-watchdog.conf"])
        lab.svc.systemctl("daemon-reload")
    assert (failed["exit_status"], failed["restarts"]) == (3, 0)
    assert not lab.unit_lines(f"gpu-mon-job-{job}-r1.service"), "the finished job ran again"


def test_a_gpu_someone_took_while_gpu_mon_was_away_is_yielded_at_the_first_look(lab: Lab):
    job = lab.submit("stubborn")
    info = lab.report(job, 0)
    lab.svc.systemctl("stop", UNIT)
    foreign = "gpu-mon-test-foreign.service"
    device = _device_of(lab, info["cuda"])
    lab.box.run(["systemd-run", "--collect", f"--unit={foreign}", "/usr/bin/python3", "-c", OPENER, device])
    try:
        lab.svc.wait_line(r"^opened at ([\d.]+)$", unit=foreign)
        started = time.time()
        lab.svc.systemctl("start", UNIT)
        _taken_over(lab, job, started)
        stopping, _m = lab.svc.wait_line(rf"busy: root python3\[\d+\] holds {device}; stopping job {job}$")
        assert stopping - started < 10, stopping - started
        gone = lambda: not lab.alive(info["child"]) and not lab.alive(info["pid"])  # noqa: E731
        wait_for(gone, 3 + 5, "the job's processes gone")
        again = lab.wait_job(job, "done", restarts=1)
    finally:
        lab.box.run(["systemctl", "stop", foreign], check=False)
    assert again["exit_status"] == 0


def test_a_job_that_ends_while_gpu_mon_is_stopped_keeps_its_own_end(lab: Lab):
    flag = f"/home/{USER}/qjob-go"
    job = lab.submit("until", flag, "3", options=("--notify", HOOK))
    lab.report(job, 0)
    lab.svc.systemctl("stop", UNIT)  # (systemd removes /run/gpu_mon with it)
    lab.box.run(["touch", flag])
    record = lab.box.path(f"/var/lib/gpu_mon/gpu-mon-job-{job}-r0.end")
    wait_for(record.exists, 10, "the end recorded by the job's unit itself")
    assert record.read_text() == "unit exited 3\n" and record.stat().st_mode & 0o777 == 0o600
    lab.svc.systemctl("start", UNIT)
    failed = lab.wait_job(job, "failed")
    assert (failed["exit_status"], failed["restarts"]) == (3, 0)
    said = rf"^gpu-mon: job {job} exited with status 3 at [\d:]+, while gpu-mon was away: failed$"
    wait_for(lambda: re.search(said, lab.log(job).read_text(), re.M), 10, "the end's line in the log")
    wait_for(lambda: f"hook {job} failed 3" in lab.log(job).read_text(), 20, "its hook, told of its own end")
    assert not lab.unit_lines(f"gpu-mon-job-{job}-r1.service"), "the finished job ran again"
    assert not record.exists() and not _guard_armed(lab)


def test_a_stop_that_lasts_has_systemd_stop_the_jobs_which_go_back_to_the_queue(lab: Lab):
    _write_config(lab.box, CONFIG + "unguarded_seconds = 2\n")
    lab.svc.systemctl("restart", UNIT)
    flag = f"/home/{USER}/qjob-go"
    job = lab.submit("until", flag, "0", "4", options=("--grace", "8"))
    info = lab.report(job, 0)
    lab.svc.systemctl("stop", UNIT)
    stopped = time.time()
    wait_for(lambda: _guard_armed(lab), 10, "the guard armed")
    signals = lab.home(f"qjob-{job}-0.signals")
    wait_for(signals.exists, 2 + 10, "systemd's stop signal to the job, the guard's bound after")
    took = time.time() - stopped
    assert 1.5 < took < 2 + 5, took
    assert signals.read_text() == "SIGTERM\n"
    termed = time.time()
    # Its grace is its own (8 s, its unit's TimeoutStopSec=): its 4 s checkpoint is not cut short.
    wait_for(lambda: not lab.alive(info["pid"]), 10, "the job gone")
    assert time.time() - termed > 3.5, time.time() - termed
    unit = f"gpu-mon-job-{job}-r0.service"
    ended = lambda: lab.box.show(unit, "ActiveState")["ActiveState"] in ("inactive", "failed")  # noqa: E731
    wait_for(ended, 10, f"{unit} ended (its ExecStopPost= run)")
    lab.svc.systemctl("start", UNIT)
    lab.box.run(["touch", flag])
    again = lab.wait_job(job, "done", restarts=1)
    assert again["exit_status"] == 0
    said = (
        rf"^gpu-mon: job {job} at [\d:]+: systemd stopped it while gpu-mon was away; requeued \(restart 1\)$"
    )
    found = lambda: re.search(said, lab.log(job).read_text(), re.M)  # noqa: E731
    wait_for(found, 10, f"the requeue's line in the log: {lab.log(job).read_text()!r}")


@contextlib.contextmanager
def _nodes_of_the_driver(lab: Lab) -> Iterator[None]:
    """The simulated GPUs' nodes as the driver makes them: character devices of NVIDIA's major, minor =
    index (with no driver loaded, an open the device cgroup lets through fails with ENXIO, one it refuses
    with EPERM); gpu-mon restarted on them, and on the plain files again afterwards."""
    host = lab.svc.host
    made = []
    try:
        for i, g in enumerate(host.gpus):
            node = host.dir / "dev" / f"char{i}"
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(transient.NVIDIA_MAJOR, i))
            os.chmod(
                node, 0o666
            )  # (as the driver's: anyone may open it; mknod's mode went through the umask)
            made.append(node)
            g["device"] = f"dev/char{i}"
        host.write()
        lab.svc.systemctl("restart", UNIT)
        yield
    finally:
        for i, g in enumerate(host.gpus):
            g["device"] = f"dev/nvidia{i}"
        host.write()
        for node in made:
            node.unlink()


def test_a_job_can_open_only_its_own_gpus_node_and_disturbs_no_one_elses(lab: Lab):
    with _nodes_of_the_driver(lab):
        flag = f"/home/{USER}/qjob-go"
        other = lab.submit("until", flag, "0")
        theirs = lab.report(other, 0)["cuda"]
        prober = lab.submit("probe")
        info = lab.report(prober, 0)
        mine = info["cuda"]
        assert info["probes"][mine] == "ENXIO", info["probes"]  # (let through: no driver here)
        assert [v for u, v in info["probes"].items() if u != mine] == ["EPERM", "EPERM"], info["probes"]
        assert lab.wait_job(prober, "done")["exit_status"] == 0
        # What its unit may open: its GPU's node by number, the driver's shared ones; no other GPU's.
        unit = f"gpu-mon-job-{other}-r0.service"
        index = next(i for i in range(3) if lab.svc.host.uuid(i) == theirs)
        assert lab.box.show(unit, "DevicePolicy")["DevicePolicy"] == "closed"
        allowed = lab.box.run(["systemctl", "show", unit, "--property=DeviceAllow"]).stdout
        assert f"/dev/char/195:{index} rw" in allowed and "/dev/char/195:255 rw" in allowed, allowed
        assert not [
            f"/dev/char/195:{i} " for i in range(3) if i != index and f"/dev/char/195:{i} " in allowed
        ]
        # The refused open reached no one: the other job runs on, never stopped.
        assert lab.job(other)["state"] == "running"
        assert not [line for _t, line in lab.svc.lines() if "; stopping job" in line]
        lab.box.run(["touch", flag])
        assert lab.wait_job(other, "done")["exit_status"] == 0
    assert theirs != mine


def test_a_unit_systemd_refuses_fails_the_job_with_the_reason_in_the_log(lab: Lab):
    blocker = "gpu-mon-job-1-r0.service"  # the name the next job's first run takes, already in use
    lab.box.run(["systemd-run", "--collect", f"--unit={blocker}", "sleep", "60"])
    try:
        job = lab.submit("exit", "0")
        assert job == 1
        failed = lab.wait_job(job, "failed")
    finally:
        lab.box.run(["systemctl", "stop", blocker], check=False)
    assert failed["exit_status"] == 126
    lab.svc.wait_line(rf"^job {job}\[\d+\]: Failed to start transient service unit: .*{blocker}")
    lab.svc.wait_line(rf"^queue: job {job} of {USER} could not start .*: failed$")
    assert not lab.home(f"qjob-{job}-0.json").exists()


def test_a_job_whose_output_cannot_be_opened_fails_with_what_its_unit_said(lab: Lab):
    target = "/var/lib/gpu_mon/out.log"  # (gpu-mon's state directory: root's, the user may not write in it)
    with pytest.raises(AssertionError, match=f"cannot open {target}: Permission denied"):
        lab.submit("exit", "0", options=("--output", target))  # (the client checks as the user first)
    # Made unwritable after the submit (the client's check passed): the unit says why it cannot start.
    mine = f"/home/{USER}/closed"
    lab.box.run(["install", "-d", "-o", USER, mine])
    target = f"{mine}/out.log"
    job = lab.submit("exit", "0", options=("--output", target, "--hold"))
    lab.box.run(["chown", "root:root", mine])
    lab.box.run(["chmod", "0755", mine])
    lab.box.run([_gpu_mon(), "--config", CLIENT_CONF, "release", str(job)])
    failed = lab.wait_job(job, "failed")
    assert failed["reason"] == f"cannot open {target}: Permission denied", failed
    assert failed["exit_status"] == 126 and not lab.box.path(target).exists()
    assert not lab.home(f"qjob-{job}-0.json").exists()  # its command never ran
    assert not list(lab.box.path("/run/gpu_mon").glob("*.err"))  # (read back, then removed)
    # a job that opens its output has nothing in that file: its errors go to its output
    fine = lab.submit("exit", "5")
    assert lab.wait_job(fine, "failed")["reason"] == ""
    assert not list(lab.box.path("/run/gpu_mon").glob("*.err"))


# What a job's environment may hold: systemd's environment-file parser must take each literally.
TRICKY = {
    "QT_QUOTES": "it's \"quoted\" and 'twice'",
    "QT_DOLLAR": "$HOME ${USER} $$ %n %% `id`",
    "QT_SPACES": "  two  spaces  ",
    "QT_TAB": "a\tb",
    "QT_NEWLINE": "line one\nline two",
    "QT_UNICODE": "héllo ✓",
    "QT_EMPTY": "",
    "QT_EQUALS": "a=b=c",
    "QT_HASH": "#not a comment",
    "QT_BACKSLASH": "ends with \\",
}


def test_a_jobs_environment_reaches_it_intact_and_is_never_on_a_command_line(lab: Lab):
    secret = "hunter2-" + str(os.getpid())
    env = {**TRICKY, "QT_SECRET": secret}
    job = lab.submit("run", extra=tuple(f"{k}={v}" for k, v in env.items()))
    info = lab.report(job, 0)
    assert info["env"] == env
    # Another user on the machine reads every command line (ps): the job's environment is not in any.
    ps = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ps", "-eo", "args"]
    seen = lab.box.run(ps).stdout
    assert "systemd-run" in seen and "EnvironmentFile=" in seen and secret not in seen, seen
    files = list(lab.box.path("/run/gpu_mon").glob(f"gpu-mon-job-{job}-r0.service.env"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600 and files[0].stat().st_uid == 0
    lab.box.run([_gpu_mon(), "--config", CLIENT_CONF, "cancel", str(job)])
    lab.wait_job(job, "cancelled")
    assert not files[0].exists()  # (removed when the run ended)


def test_a_daemon_outside_any_unit_that_dies_leaves_its_job_to_the_next_one(lab: Lab, tmp_path: Path):
    lab.svc.systemctl("stop", UNIT)
    log = tmp_path / "daemon.log"
    path = ":".join([CHECKOUT] + [f"{CHECKOUT}-site{i}" for i in range(len(under._site_dirs()))])
    env = ["env", "-i", f"GPU_MON_SIM={SIM}", f"PYTHONPATH={path}", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
    argv = ["nsenter", "-t", str(lab.box.pid), "-a", *env, os.path.realpath(sys.executable), "-m", "gpu_mon"]
    with open(log, "wb") as out:
        plain = subprocess.Popen([*argv, "run"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "queue: listening" in log.read_text(), 20, "the daemon's queue")
        assert "queue: jobs run as transient units in gpu_mon_jobs.slice; they outlive" in log.read_text()
        job = lab.submit("stubborn")
        info = lab.report(job, 0)
        (daemon,) = [
            p
            for p in psutil.Process(plain.pid).children(recursive=True)
            if p.cmdline()[-2:] == ["gpu_mon", "run"]
        ]
        daemon.kill()
        # Its leader, left behind, arms the guard and lets go of the unit: the job runs on.
        wait_for(lambda: _guard_armed(lab), 10, "the guard armed")
        assert lab.alive(info["pid"]) and lab.alive(info["child"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(plain.pid, signal.SIGKILL)
        plain.wait()
    started = time.time()
    lab.svc.systemctl("start", UNIT)
    _taken_over(lab, job, started)
    lab.box.run([_gpu_mon(), "--config", CLIENT_CONF, "cancel", str(job)])
    cancelled = lab.wait_job(job, "cancelled")
    assert cancelled["restarts"] == 0 and not lab.alive(info["pid"]) and not lab.alive(info["child"])


def test_the_launcher_is_systemd_only_where_systemd_runs_the_machine(tmp_path: Path):
    none = str(tmp_path / "no-systemd")
    assert transient.choose("auto", True, run_dir=none) is False
    assert transient.choose("auto", True, run_dir=str(tmp_path)) is True  # (systemd-run is installed)
    assert transient.choose("auto", False, run_dir=str(tmp_path)) is False  # not root: the user's own jobs
    assert transient.choose("direct", True, run_dir=str(tmp_path)) is False
    with pytest.raises(transient.LauncherError, match="systemd does not run this machine"):
        transient.choose("systemd", True, run_dir=none)
    with pytest.raises(transient.LauncherError, match="not running as root"):
        transient.choose("systemd", False, run_dir=str(tmp_path))


def test_a_units_file_is_always_a_new_root_only_one(tmp_path: Path):
    """A unit's environment file where another user left one (state_file in a sticky directory like /tmp):
    that file is neither written through (the job's tokens to its owner) nor kept (its lines in the job's
    environment); a new 0600 one takes its name."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o1777)
    name = "gpu-mon-job-7-r0.service"
    planted = run / f"{name}.env"
    planted.write_text("LD_PRELOAD=/tmp/evil.so\n")
    os.chmod(planted, 0o666)
    held = os.open(planted, os.O_RDONLY)  # its owner keeps it open, to read what would be written
    try:
        path = transient.env_file(str(run), name, {"TOKEN": 's3"cret'})
        st = os.stat(path)
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
        assert Path(path).read_text() == 'TOKEN="s3\\"cret"\n'
        assert os.read(held, 100) == b"LD_PRELOAD=/tmp/evil.so\n"
        assert transient.stderr_file(str(run), name) == str(run / f"{name}.err")
        assert transient.unit_ended(str(run), name) == "" and sorted(os.listdir(run)) == []
    finally:
        os.close(held)
