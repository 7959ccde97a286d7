"""The queue for real: users created here submit with `gpu-mon submit` (run as them, from a copy of the
package they can read) to a real daemon (root) on the simulated GPUs; jobs are real processes."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import resource
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
from conftest import ROOT, Daemon, foreign_open, kill_marked, names_held, pid_alive, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

PY = "/usr/bin/python3"
GROUP = "gmqlab"
JOB = r"""
import json, os, signal, sys, time
env = os.environ
restart = int(env.get("GPU_MON_RESTART_COUNT", "-1"))
report = os.path.join(os.getcwd(), "report-" + env.get("GPU_MON_JOB_ID", "x") + ".jsonl")

def say(event, **kw):
    with open(report, "a") as f:
        f.write(json.dumps(dict(event=event, t=time.time(), restart=restart, **kw)) + "\n")

def stop(signum, frame):
    say("signal", sig=signum)
    if sys.argv[1] == "slowstop":  # a checkpoint that takes a while
        time.sleep(1.5)
        say("end")
    sys.exit(0 if signum == signal.SIGUSR1 else 143)

# (the handlers before "start": a test that stops the job once it has started expects them in place)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGUSR1, stop)
say("start", uid=os.getuid(), gid=os.getgid(), groups=sorted(os.getgroups()), cwd=os.getcwd(),
    cuda=env.get("CUDA_VISIBLE_DEVICES"), order=env.get("CUDA_DEVICE_ORDER"), job=env.get("GPU_MON_JOB_ID"),
    secret=env.get("SECRET"), pid=os.getpid())
with open(os.path.join(env["HOME"], "wrote-home-" + env.get("GPU_MON_JOB_ID", "x")), "w") as f:
    f.write("ok")
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "ckpt" and restart >= 1:
    say("resumed")
    sys.exit(0)
while True:
    time.sleep(0.05)
    if mode == "slowstop":
        say("tick")
"""


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path

    @property
    def work(self) -> Path:
        return self.home / "work"


@dataclass
class Lab:
    dir: Path
    code: Path
    job: Path
    client_conf: Path
    socket: Path
    database: Path
    alice: User
    bob: User
    marker: str

    def run(
        self,
        user: User,
        *args: str,
        cwd: Optional[Path] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess:
        """`gpu-mon ARGS` as this user, from the user's work directory, with the test's marker in its env."""
        full_env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(user.home),
            "USER": user.name,
            "PYTHONPATH": str(self.code),
            "LANG": "C.UTF-8",
            "GMQ_MARK": self.marker,
        }
        full_env.update(env or {})
        groups = os.getgrouplist(user.name, user.gid)
        return subprocess.run(
            [PY, "-m", "gpu_mon", "--config", str(self.client_conf), *args],
            capture_output=True,
            text=True,
            user=user.uid,
            group=user.gid,
            extra_groups=groups,
            cwd=str(cwd or user.work),
            env=full_env,
            timeout=timeout,
        )

    def submit(self, user: User, *args: str, **kw) -> int:
        r = self.run(user, "submit", "--json", *args, **kw)
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)["id"])

    def job_cmd(self, *args: str) -> List[str]:
        return ["--", PY, str(self.job), *args, self.marker]

    def jobs(self, user: User, *args: str) -> Dict[int, dict]:
        r = self.run(user, "jobs", "--json", "--all", *args)
        assert r.returncode == 0, r.stderr
        return {j["id"]: j for j in json.loads(r.stdout)["jobs"]}

    def wait_state(self, user: User, job_id: int, state: str, timeout: float = 30) -> dict:
        return wait_for(  # type: ignore[return-value]
            lambda: (j := self.jobs(user).get(job_id)) and j["state"] == state and j,
            timeout,
            f"job {job_id} {state}",
            interval=0.1,
        )

    def wait_running(self, user: User, job_id: int) -> List[dict]:
        """Wait until the job runs and has reported its start: its reports."""
        self.wait_state(user, job_id, "running")
        return wait_for(  # type: ignore[return-value]
            lambda: self.reports(user, job_id), 20, "the job's first report"
        )

    def reports(self, user: User, job_id: int) -> List[dict]:
        path = user.work / f"report-{job_id}.jsonl"
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except OSError:
            return []


def _make_user(name: str, base: Path, groups: str = "") -> User:
    subprocess.run(["userdel", "-r", name], capture_output=True)
    home = base / name
    cmd = ["useradd", "-m", "-d", str(home), "-s", "/bin/sh", "-K", "MAIL_DIR=/nonexistent"]
    subprocess.run([*cmd, *(["-G", groups] if groups else []), name], check=True, capture_output=True)
    pw = pwd.getpwnam(name)
    os.chmod(home, 0o700)
    work = home / "work"
    work.mkdir()
    os.chown(work, pw.pw_uid, pw.pw_gid)
    return User(name, pw.pw_uid, pw.pw_gid, home)


def lab_files(base: Path, job_text: str) -> Tuple[Path, Path, Path]:
    """The package where the test's users can read it, the job script, and the client's config (the socket
    at base/run/queue.sock)."""
    code = base / "code"
    shutil.copytree(ROOT / "gpu_mon", code / "gpu_mon", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (code, *code.rglob("*")):
        os.chmod(path, 0o755)
    job = base / "job.py"
    job.write_text(job_text)
    os.chmod(job, 0o755)
    conf = base / "client.conf"
    conf.write_text(f"[queue]\nsocket = {base / 'run' / 'queue.sock'}\n")
    os.chmod(conf, 0o644)
    return code, job, conf


@contextlib.contextmanager
def made_lab(tag: str, names: Tuple[str, str], job_text: str, group: str = "") -> Iterator[Lab]:
    """Two users of a test file's own (the first also in `group`, made here), a directory they can read
    with the package, the job script and the client's config; processes marked `tag`-..., all removed
    afterwards."""
    with names_held((*names, *([group] if group else []))):
        yield from _made_lab(tag, names, job_text, group)


def _made_lab(tag: str, names: Tuple[str, str], job_text: str, group: str) -> Iterator[Lab]:
    base = Path(tempfile.mkdtemp(prefix=f"gpu-mon-{tag}-", dir="/tmp"))
    os.chmod(base, 0o755)
    if group:
        subprocess.run(["groupdel", group], capture_output=True)
        subprocess.run(["groupadd", group], check=True, capture_output=True)
    users: List[User] = []
    marker = f"{tag}-{os.getpid()}-{time.monotonic_ns()}"
    try:
        for name in names:
            users.append(_make_user(name, base, "" if users else group))
        code, job, conf = lab_files(base, job_text)
        yield Lab(base, code, job, conf, base / "run" / "queue.sock", base / "queue.sqlite", *users, marker)
    finally:
        with contextlib.suppress(Exception):
            kill_marked(marker)
        for u in users:
            subprocess.run(["pkill", "-KILL", "-u", u.name], capture_output=True)  # only the test's users
            subprocess.run(["userdel", "-r", u.name], capture_output=True)
        if group:
            subprocess.run(["groupdel", group], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def lab(sim):
    """Two users (alice in a supplementary group), a directory they can read with the package, the job
    script and the client's config; all removed afterwards."""
    with made_lab("gmq", ("gmqalice", "gmqbob"), JOB, GROUP) as made:
        yield made


def queue_body(lab: Lab, extra: str = "", gpus: str = "ALL") -> str:
    return (
        "[gpu-all]\ngpus = ALL\n"
        f"[queue]\nsocket = {lab.socket}\ndatabase = {lab.database}\ngpus = {gpus}\n"
        f"grace_seconds = 5\nlauncher = direct\n{extra}"  # (the supervisor's path even where systemd runs)
    )


def started_order(d) -> List[int]:
    return [
        int(line.split("starting job ", 1)[1].split("[", 1)[0])
        for line in d.log().splitlines()
        if "queue: starting job " in line
    ]


# ------------------------------------------------------------------------------------------------------


def test_two_users_jobs_run_as_each_user_in_their_directory_with_their_env_and_one_gpu(
    lab, daemon_factory, sim
):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    assert os.stat(lab.socket).st_mode & 0o777 == 0o666
    assert os.stat(lab.socket.parent).st_mode & 0o777 == 0o755 and os.stat(lab.socket.parent).st_uid == 0
    r = lab.run(lab.alice, "submit", *lab.job_cmd("exit", "0"), env={"SECRET": "alice's"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "job 1 queued (0 ahead)\n"
    b = lab.submit(lab.bob, *lab.job_cmd("exit", "0"), env={"SECRET": "bob's"})
    for user, job_id in ((lab.alice, 1), (lab.bob, b)):
        job = lab.wait_state(user, job_id, "done")
        (start,) = [e for e in lab.reports(user, job_id) if e["event"] == "start"]
        gid = user.gid
        assert (start["uid"], start["gid"], start["cwd"]) == (user.uid, gid, str(user.work))
        assert start["secret"] == ("alice's" if user is lab.alice else "bob's")
        assert start["cuda"] in (sim.uuid(0), sim.uuid(1)) and start["order"] == "PCI_BUS_ID"
        assert (start["job"], start["restart"]) == (str(job_id), 0)
        assert job["exit_status"] == 0 and job["user"] == user.name and job["gpus_wanted"] == 1
        # its output file and the files it wrote are the user's, never root's
        log = user.home / ".local/state/gpu-mon/jobs" / f"{job_id}.log"
        assert log.exists() and log.stat().st_uid == user.uid
        assert (user.home / f"wrote-home-{job_id}").stat().st_uid == user.uid
    alice_groups = set(lab.reports(lab.alice, 1)[0]["groups"])
    assert grp.getgrnam(GROUP).gr_gid in alice_groups
    assert grp.getgrnam(GROUP).gr_gid not in set(lab.reports(lab.bob, b)[0]["groups"])
    # the two jobs had different GPUs or ran one after the other: never one GPU twice at once
    d.wait_log(r"queue: job \d+ of gmqbob exited with status 0: done")


def test_a_foreign_open_stops_a_job_with_its_signal_and_it_reruns_with_restart_count_1(
    lab, daemon_factory, sim
):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0.3}, args=("--debug",))
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, "--stop-signal", "USR1", *lab.job_cmd("ckpt"))
    lab.wait_running(lab.alice, job_id)
    with foreign_open(sim.device(0)):
        # (once the opener has held the node for [queue] brief_open_seconds: tests/test_queue_probes.py)
        d.wait_log(r"busy: root .*; stopping job 1")
        job = lab.wait_state(lab.alice, job_id, "queued")
        assert job["restarts"] == 1 and job["ran_seconds"] is not None  # (the first run's, in TIME too)
        reason = lambda: lab.jobs(lab.alice)[job_id]["reason"]  # noqa: E731
        wait_for(lambda: "GPU 0 busy: root" in reason(), 10, "the reason")  # it waits, and says for whom
        events = [(e["event"], e["restart"]) for e in lab.reports(lab.alice, job_id)]
        assert events == [("start", 0), ("signal", 0)]  # the checkpoint signal, not SIGTERM
        assert lab.reports(lab.alice, job_id)[1]["sig"] == signal.SIGUSR1
    lab.wait_state(lab.alice, job_id, "done")
    events = [(e["event"], e["restart"]) for e in lab.reports(lab.alice, job_id)]
    assert events == [("start", 0), ("signal", 0), ("start", 1), ("resumed", 1)]
    r = lab.run(lab.alice, "logs", str(job_id))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "order, expected, ahead",
    [("fifo", [1, 2, 3, 4], "3 jobs ahead"), ("fair", [1, 4, 2, 3], "1 job ahead")],
)
def test_fair_order_lets_a_user_with_one_job_in_before_anothers_many(
    lab, daemon_factory, sim, order, expected, ahead
):
    d = daemon_factory(queue_body(lab, f"order = {order}\n", gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    with foreign_open(sim.device(0)):
        d.wait_log("GPU 0 .*busy")
        for _ in range(3):
            lab.submit(lab.alice, *lab.job_cmd("exit", "0"))
        lab.submit(lab.bob, *lab.job_cmd("exit", "0"))
        jobs = wait_for(lambda: (j := lab.jobs(lab.bob))[4]["reason"] != "waiting: just submitted" and j, 10)
        assert "GPU 0 busy: root" in jobs[1]["reason"] and jobs[4]["reason"] == f"waiting: {ahead}"
    lab.wait_state(lab.bob, 4, "done")
    for i in (1, 2, 3):
        lab.wait_state(lab.alice, i, "done")
    assert started_order(d) == expected


def test_limits_refuse_or_hold_back_a_users_jobs(lab, daemon_factory):
    extra = "max_running_per_user = 1\nmax_queued_per_user = 2\nmax_gpus_per_job = 1\n"
    daemon_factory(queue_body(lab, extra), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    first = lab.submit(lab.alice, *lab.job_cmd("forever"))
    second = lab.submit(lab.alice, *lab.job_cmd("forever"))
    lab.wait_state(lab.alice, first, "running")
    wait_for(
        lambda: lab.jobs(lab.alice)[second]["reason"] == "waiting: gmqalice has 1 running (limit 1)",
        20,
        "the limit as the reason",
    )
    r = lab.run(lab.alice, "submit", *lab.job_cmd("forever"))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == "gpu-mon: gmqalice already has 2 unfinished jobs (limit 2)\n"
    r = lab.run(lab.bob, "submit", "--gpus", "2", *lab.job_cmd("forever"))
    assert (r.returncode, r.stderr) == (1, "gpu-mon: --gpus 2 is over the limit of 1 per job\n")
    big = lab.run(lab.bob, "submit", "--", "true", "x" * 70000)
    assert (big.returncode, big.stderr) == (1, "gpu-mon: command too long (70006 bytes; at most 65536)\n")
    r = lab.run(lab.bob, "submit", "--name", "n" * 65, "--", "true")
    assert (r.returncode, r.stderr) == (1, "gpu-mon: name too long (65 characters; at most 64)\n")
    r = lab.run(lab.bob, "submit", "--", "true", env={f"HUGE{i}": "x" * 100000 for i in range(3)})
    assert r.returncode == 1 and r.stderr.startswith("gpu-mon: environment too large (")
    r = lab.run(lab.bob, "submit", "--stop-signal", "NOPE", "--", "true")
    assert (r.returncode, r.stderr) == (2, "gpu-mon: --stop-signal 'NOPE' is not a signal name\n")
    bob = lab.submit(lab.bob, *lab.job_cmd("forever"))  # another user is not held back by alice's limit
    lab.wait_state(lab.bob, bob, "running")


def test_after_chains_a_failed_dependency_cancels_and_a_time_limit_ends_as_timeout(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    one = lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"))
    two = lab.submit(lab.alice, "--after", str(one), *lab.job_cmd("exit", "0"))
    bad = lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "3"))
    after_bad = lab.submit(lab.bob, "--after", f"{one},{bad}", *lab.job_cmd("exit", "0"))
    jobs = wait_for(lambda: (j := lab.jobs(lab.alice))[two]["reason"] != "waiting: just submitted" and j, 10)
    assert jobs[one]["state"] == "held" and jobs[two]["reason"] == f"waiting: after job {one}"
    assert lab.run(lab.alice, "release", str(one), str(bad)).returncode == 0
    assert lab.wait_state(lab.alice, bad, "failed")["exit_status"] == 3
    lab.wait_state(lab.alice, two, "done")
    cancelled = lab.wait_state(lab.bob, after_bad, "cancelled")
    assert cancelled["reason"] == f"dependency never met: afterok:{bad} (job {bad} failed)"
    assert lab.reports(lab.bob, after_bad) == []  # it never ran
    assert lab.reports(lab.alice, two)[0]["t"] >= lab.reports(lab.alice, one)[-1]["t"]
    r = lab.run(lab.alice, "submit", "--wait", "--time-limit", "1", *lab.job_cmd("forever"))
    assert r.returncode == 124, r.stderr
    job_id = int(r.stdout.split()[1])
    assert lab.jobs(lab.alice)[job_id]["state"] == "timeout"


def test_only_the_owner_or_root_may_cancel_hold_release_or_read_a_job(lab, daemon_factory, sim):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, "--hold", *lab.job_cmd("forever"))
    for op in ("cancel", "hold", "release"):
        r = lab.run(lab.bob, op, str(job_id))
        assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {job_id} is gmqalice's, not yours\n")
    r = lab.run(lab.bob, "logs", str(job_id))
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {job_id} is gmqalice's, not yours\n")
    assert lab.jobs(lab.bob)[job_id]["state"] == "held"  # anyone may list
    assert lab.run(lab.alice, "release", str(job_id)).returncode == 0
    lab.wait_state(lab.alice, job_id, "running")
    r = lab.run(lab.alice, "cancel", str(job_id))
    assert (r.returncode, r.stdout) == (0, f"job {job_id}: stopping\n")
    job = lab.wait_state(lab.alice, job_id, "cancelled")
    assert job["reason"] == "cancelled by gmqalice while running"  # (who, as a queued job's says)
    assert [e["event"] for e in lab.reports(lab.alice, job_id)] == ["start", "signal"]


@pytest.mark.parametrize("containment", ["subreaper", "auto"])
def test_a_daemon_killed_with_a_job_running_requeues_it_and_never_runs_it_twice(
    lab, daemon_factory, containment
):
    defaults = {"start_delay_seconds": 0, "containment": containment}
    d = daemon_factory(queue_body(lab, gpus="0"), defaults=defaults)
    wait_for(lab.socket.exists, 20, "the queue's socket")
    running = lab.submit(lab.alice, *lab.job_cmd("slowstop"))
    waiting = lab.submit(lab.bob, *lab.job_cmd("exit", "0"))
    first = lab.wait_running(lab.alice, running)[0]
    wait_for(lambda: len(lab.reports(lab.alice, running)) > 3, 20, "the first run ticking")
    d.signal(signal.SIGKILL)
    d.proc.wait(10)
    log_before = d.log()
    d.start()  # the same config, the same database
    d.wait_log(r"queue: job 1(: the processes an earlier|: gpu-mon stopped while it ran)")
    second = wait_for(
        lambda: [e for e in lab.reports(lab.alice, running) if e["event"] == "start"][1:],
        30,
        "the second run",
    )[0]
    old = [e for e in lab.reports(lab.alice, running) if e["restart"] == 0]
    assert max(e["t"] for e in old) <= second["t"]  # the first run was gone before the second began
    if containment == "subreaper":  # (a dead daemon's cgroups are killed at once by the next daemon)
        assert old[-1]["event"] == "end"  # it had its grace: the old leader stopped it, and was waited for
    assert not pid_alive(first["pid"])
    assert second["restart"] == 1
    jobs = lab.jobs(lab.bob)
    assert jobs[running]["state"] == "running" and jobs[running]["restarts"] == 1
    assert jobs[waiting]["state"] == "queued"  # still queued: nothing was lost
    assert "queue: starting job 1" in log_before
    assert lab.run(lab.alice, "cancel", str(running)).returncode == 0
    lab.wait_state(lab.bob, waiting, "done")


def test_a_queued_job_takes_a_gpu_from_a_process_workload(lab, daemon_factory, tmp_path):
    body = queue_body(lab, gpus="0") + (
        f"[process-miner]\ncmd = {PY} -c 'import time; time.sleep(600)' {lab.marker}\ngpus = 0\n"
    )
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    d.wait_log(r"starting miner\[")
    job_id = lab.submit(lab.alice, *lab.job_cmd("sleep"))
    d.wait_log(r"queue: job 1 takes GPU 0 .*; stopping miner\[")
    lab.wait_state(lab.alice, job_id, "running")
    gpu0 = lambda: [g for g in d.state().get("gpus", []) if g["index"] == 0] or [{}]  # noqa: E731
    wait_for(lambda: gpu0()[0].get("state") == "running job 1", 20, "GPU 0 running the job (`status`)")
    miner = d.workload("miner")
    assert miner["state"] != "running" and "job 1" in json.dumps(miner), miner
    assert lab.run(lab.alice, "cancel", str(job_id)).returncode == 0
    lab.wait_state(lab.alice, job_id, "cancelled")
    d.wait_log(r"starting miner\[", count=2)  # the workload has its GPU back


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


def _answer(s: socket.socket) -> dict:
    s.settimeout(10)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return json.loads(data[4:])


def test_garbage_and_silent_clients_get_one_line_and_never_block_a_submit(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    silent = [_connect(lab.socket) for _ in range(50)]
    try:
        garbage = _connect(lab.socket)
        garbage.sendall(struct.pack(">I", 5) + b"hello")
        assert _answer(garbage) == {"ok": False, "error": "not a JSON message", "code": 2}
        huge = _connect(lab.socket)
        huge.sendall(struct.pack(">I", 1 << 30))
        assert _answer(huge)["error"] == "frame too large (1073741824 bytes; at most 1048576)"
        liar = _connect(lab.socket)  # a client that claims to be someone else is still itself
        liar.sendall(struct.pack(">I", 0) + b"")
        liar.close()
        r = lab.run(lab.bob, "submit", *lab.job_cmd("exit", "0"))
        assert r.returncode == 0, r.stderr
        # the submit was answered while every silent client was still connected, waiting
        for s in silent:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in silent:
            s.close()
    late = _connect(lab.socket)
    assert _answer(late) == {"ok": False, "error": "no request in time", "code": 2}  # after a few seconds


def test_no_daemon_and_queue_off_are_one_line(lab, tmp_path):
    r = lab.run(lab.alice, "jobs")
    assert r.returncode == 1 and r.stderr.startswith("gpu-mon: no gpu-mon daemon answers on ")
    off = lab.dir / "off.conf"
    off.write_text("[gpu-all]\ngpus = ALL\n")
    os.chmod(off, 0o644)
    r = lab.run(lab.alice, "--config", str(off), "jobs")
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: the queue is off: {off} has no [queue] section\n")


def test_a_stopped_daemon_requeues_its_running_job_and_a_second_daemon_never_shares_the_queue(
    lab, daemon_factory, sim, tmp_path
):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, *lab.job_cmd("forever"))
    lab.wait_state(lab.alice, job_id, "running")
    other_dir = tmp_path / "second"
    other_dir.mkdir()
    other = Daemon(other_dir, sim, queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    try:
        other.start()
        other.wait_log(r"queue: cannot start the queue: another gpu-mon daemon is running \(pid \d+; lock ")
        assert other.proc is not None and other.proc.poll() is None  # it runs on, without the queue
        assert lab.jobs(lab.bob)[job_id]["state"] == "running"  # the first one still serves it
    finally:
        other.cleanup()
    assert d.stop() == 0
    d.wait_log(r"queue: job 1 of gmqalice .*: back in the queue")
    assert not lab.socket.exists()
    with contextlib.closing(sqlite3.connect(lab.database)) as db:
        (data,) = db.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
    assert (json.loads(data)["state"], json.loads(data)["restarts"]) == ("queued", 1)
    d.start()
    wait_for(lab.socket.exists, 20, "the queue's socket again")
    job = lab.wait_state(lab.alice, job_id, "running")
    assert job["restarts"] == 1
    starts = wait_for(
        lambda: [e["restart"] for e in lab.reports(lab.alice, job_id) if e["event"] == "start"][1:],
        20,
        "the second run's report",
    )
    assert starts == [1]


def test_a_thousand_connections_at_once_never_keep_another_users_submit_out(lab, daemon_factory):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        try:  # (root may raise its hard limit; a container that forbids it fails here, in one line)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, 1300))
        except (ValueError, OSError) as err:
            pytest.fail(f"needs 1300 open files; the hard limit is {hard} and cannot be raised: {err}")
        hard = 1300
    # The daemon may have 300 files open (it then serves at most 44 clients at once): the crowd cannot
    # all be served together, and the one who crowds loses their own oldest connections, nobody else's.
    resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
    try:
        daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1300), hard))
    try:
        wait_for(lab.socket.exists, 20, "the queue's socket")
        crowd = [_connect(lab.socket) for _ in range(1000)]
        try:
            r = lab.run(lab.bob, "submit", *lab.job_cmd("exit", "0"))
            assert r.returncode == 0, r.stderr
            assert r.stdout.startswith("job 1 queued")
            evicted = 0
            for s in crowd[:100]:  # the first of the crowd were told why, in one line
                s.settimeout(10)
                if _answer(s) == {"ok": False, "error": "too many connections from you at once", "code": 1}:
                    evicted += 1
            assert evicted == 100
        finally:
            for s in crowd:
                s.close()
        lab.wait_state(lab.bob, 1, "done")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_output_logs_follow_wait_and_no_requeue(lab, daemon_factory, sim):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    out = lab.alice.work / "mine.out"
    code = "import sys; print('line one', flush=True); print('to stderr', file=sys.stderr); sys.exit(3)"
    r = lab.run(lab.alice, "submit", "--wait", "--output", "mine.out", "--", PY, "-c", code)
    assert r.returncode == 3, r.stderr  # --wait: the job's own status
    assert r.stdout == "job 1 queued (0 ahead)\n" and r.stderr == "job 1 failed\n"
    assert out.read_text() == "line one\nto stderr\n" and out.stat().st_uid == lab.alice.uid
    assert out.stat().st_mode & 0o777 == 0o600  # made by the job, as alice, for alice
    r = lab.run(lab.alice, "logs", "1")
    assert (r.returncode, r.stdout) == (0, "line one\nto stderr\n")
    text = lab.run(lab.alice, "jobs", "--all").stdout.splitlines()
    assert text[0].split() == [
        "ID",
        "USER",
        "STATE",
        "GPUS",
        "TIME",
        "END",
        "RESTARTS",
        "NAME",
        "/",
        "COMMAND",
        "WHY",
    ]
    assert text[1].split()[:3] == ["1", "gmqalice", "failed"] and text[1].endswith("exited with status 3")
    # --no-requeue: preempted once, it ends as `preempted`; `logs --follow` prints until the end
    job_id = lab.submit(lab.alice, "--no-requeue", *lab.job_cmd("forever"))
    lab.wait_state(lab.alice, job_id, "running")
    follow = subprocess.Popen(
        [PY, "-m", "gpu_mon", "--config", str(lab.client_conf), "logs", "--follow", str(job_id)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(lab.alice.work),
        user=lab.alice.uid,
        group=lab.alice.gid,
        env={"PATH": "/usr/bin:/bin", "HOME": str(lab.alice.home), "PYTHONPATH": str(lab.code)},
    )
    try:
        with foreign_open(sim.device(0)):
            job = lab.wait_state(lab.alice, job_id, "preempted")
            assert job["reason"] == "preempted (no requeue)" and job["restarts"] == 0
            assert follow.wait(20) == 0  # --follow ended with the job
    finally:
        follow.kill()
        follow.wait()
    d.wait_log(r"queue: job 2 of gmqalice .*: preempted")


def test_only_the_allowed_groups_may_submit(lab, daemon_factory):
    daemon_factory(queue_body(lab, f"groups = {GROUP}\n"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    r = lab.run(lab.bob, "submit", *lab.job_cmd("exit", "0"))
    assert (r.returncode, r.stderr) == (
        1,
        "gpu-mon: gmqbob may not submit jobs here ([queue] users and groups)\n",
    )
    assert lab.submit(lab.alice, *lab.job_cmd("exit", "0")) == 1  # a member of the group
    assert lab.run(lab.bob, "jobs").returncode == 0  # listing is for everyone


def test_the_jobs_table_lists_the_first_100_waiting_and_counts_the_rest_json_lists_all(lab, daemon_factory):
    from gpu_mon.queue.protocol import request

    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    for i in range(103):  # (root, straight to the socket: quicker than 103 commands)
        req = {"op": "submit", "command": ["true", str(i)], "cwd": "/", "env": {}, "hold": True}
        assert request(str(lab.socket), req)["state"] == "held"
    table = lab.run(lab.bob, "jobs").stdout.splitlines()
    assert len(table) == 1 + 100 + 1 and table[100].split()[:3] == ["100", "root", "held"]
    assert table[-1] == "... and 3 more queued or held (gpu-mon jobs --all or --json lists every one)"
    assert len(lab.run(lab.bob, "jobs", "--all").stdout.splitlines()) == 1 + 103
    listed = json.loads(lab.run(lab.bob, "jobs", "--json").stdout)["jobs"]
    assert [j["id"] for j in listed] == list(range(1, 104)) and "gpu_indices" not in listed[0]
    assert listed[5]["command"] == ["true", "5"] and listed[5]["reason"] == "held"


def test_a_reload_applies_queue_limits_at_once_and_keeps_the_socket_and_a_removed_queue_till_restart(
    lab, daemon_factory
):
    body = queue_body(lab, "max_running_per_user = 1\n")
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    first = lab.submit(lab.alice, *lab.job_cmd("forever"))
    second = lab.submit(lab.alice, *lab.job_cmd("forever"))
    lab.wait_state(lab.alice, first, "running")
    wait_for(
        lambda: lab.jobs(lab.alice)[second]["reason"] == "waiting: gmqalice has 1 running (limit 1)",
        20,
        "the limit as the reason",
    )
    moved = lab.dir / "elsewhere.sock"
    d.write_config(
        body.replace("max_running_per_user = 1\n", "max_running_per_user = 2\n")
        .replace(str(lab.socket), str(moved))
        .replace(str(lab.database), str(lab.dir / "other.sqlite"))
    )
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded .*; changed: \[queue\]")
    lab.wait_state(lab.alice, second, "running")  # the new limit, at once, on the old socket
    assert "reload: [queue] socket changes take effect when gpu-mon restarts" in d.log()
    assert "reload: [queue] database changes take effect when gpu-mon restarts" in d.log()
    assert not moved.exists() and not (lab.dir / "other.sqlite").exists()
    # [queue] removed: the queue and its running jobs go on until a restart (nothing left unstopped)
    d.write_config("[gpu-all]\ngpus = ALL\n")
    d.signal(signal.SIGHUP)
    d.wait_log(r"reload: \[queue\] removed: the queue and its jobs keep running until gpu-mon restarts")
    d.wait_log(r"reloaded ", count=2)
    jobs = lab.jobs(lab.bob)
    assert jobs[first]["state"] == jobs[second]["state"] == "running"
    assert lab.run(lab.alice, "cancel", str(first), str(second)).returncode == 0
    lab.wait_state(lab.alice, second, "cancelled")


def test_finished_jobs_leave_the_database_after_keep_finished_days_at_start_and_on_a_reload(
    lab, daemon_factory
):
    body = queue_body(lab, "keep_finished_days = 0\nfair_window_hours = 0.0001\n")
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    done = lab.submit(lab.alice, *lab.job_cmd("exit", "0"))
    waiting = lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"))
    lab.wait_state(lab.alice, done, "done")
    ended = time.time()
    wait_for(lambda: time.time() > ended + 1.0, 5, "the job to be a second old")
    assert set(lab.jobs(lab.alice)) == {done, waiting}  # 0: kept for ever
    # keep_finished_days = 0.00001 (0.9 s): a reload applies it at once
    d.write_config(body.replace("keep_finished_days = 0\n", "keep_finished_days = 0.00001\n"))
    d.signal(signal.SIGHUP)
    d.wait_log(r"queue: 1 finished job\(s\) older than 1e-05 day\(s\) removed from ")
    assert set(lab.jobs(lab.alice)) == {waiting}  # the held one stays
    with contextlib.closing(sqlite3.connect(lab.database)) as db:
        assert db.execute("SELECT id FROM jobs").fetchall() == [(waiting,)]
    # and when the daemon starts
    assert lab.run(lab.alice, "release", str(waiting)).returncode == 0
    lab.wait_state(lab.alice, waiting, "done")
    d.stop()
    ended = time.time()
    wait_for(lambda: time.time() > ended + 1.0, 5, "the job to be a second old")
    d.start()
    d.wait_log(r"queue: 1 finished job\(s\) older than", count=2)
    wait_for(lab.socket.exists, 20, "the queue's socket")
    assert lab.jobs(lab.alice) == {}
    assert lab.submit(lab.alice, *lab.job_cmd("exit", "0")) == waiting + 1  # ids are never reused
