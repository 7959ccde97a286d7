"""[slurm]: preemptible Slurm jobs yield to anyone else's use of their GPUs, through Slurm.

The pure parts (which process is whose job, which job must yield, what scontrol says) with real processes;
then a real one-node Slurm (Debian's munged, slurmctld, slurmd started here as plain daemons, see
slurmcluster.py) with gpu-mon on simulated GPUs whose device nodes are the GPUs of Slurm's gres.conf.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import UUIDS, foreign_opener_cmd, wait_for, workload_cmd

from gpu_mon import config
from gpu_mon.api.procfs import read_stat
from gpu_mon.slurm import control, procs
from gpu_mon.slurm.decide import Use, decide
from gpu_mon.slurm.jobs import JobInfo, Preemptible, parse_job

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurmcluster
from slurmcluster import events

# ---------------------------------------------------------------------------------------------- config


def test_the_section_needs_whose_jobs_yield_and_checks_its_keys():
    c = config.parse("[slurm]\npreemptible_partitions = scavenger, low\nsignal = USR1\naction = cancel\n")
    assert c.slurm is not None
    assert c.slurm.preemptible_partitions == ("scavenger", "low") and c.slurm.signal == signal.SIGUSR1
    assert (c.slurm.action, c.slurm.avoid_node_seconds, c.slurm.scontrol) == ("cancel", 600.0, "scontrol")
    assert config.parse("[gpu-a]\ngpus = ALL\n").slurm is None
    with pytest.raises(config.ConfigError) as err:
        config.parse("[slurm]\naction = suspend\nsignal = KILL\ntimeout_seconds = 0\n", "f.conf")
    text = "\n".join(err.value.errors)
    assert "f.conf:1: [slurm]: name preemptible_partitions or preemptible_qos" in text
    assert "f.conf:2: [slurm] action: 'suspend' is not one of requeue, cancel" in text
    assert "f.conf:3: [slurm] signal:" in text and "f.conf:4: [slurm] timeout_seconds:" in text
    with pytest.raises(config.ConfigError) as err:
        config.parse("[slurm]\npreemptible_qos = low\navoid_nodes_seconds = 5\n", "f.conf")
    assert "did you mean 'avoid_node_seconds'" in err.value.errors[0]


# ---------------------------------------------------------------------------------------------- jobs


SHOW_JOB = (
    "JobId=42 JobName=train UserId=alice(1001) GroupId=alice(1001) MCS_label=N/A Priority=1 Nice=0 "
    "Account=(null) QOS=low JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=2 "
    "ExcNodeList=node7 NodeList=node3 BatchHost=node3 Command=/home/alice/run it.sh WorkDir=/home/alice "
    "JOB_GRES=gpu:1   Nodes=node3 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0) Partition=scavenger "
    "TresPerNode=gres:gpu:1\n"
)


def test_scontrol_show_job_is_read_into_the_fields_used():
    info = parse_job(SHOW_JOB)
    assert info == JobInfo(
        job=42,
        user="alice",
        uid=1001,
        partition="scavenger",
        qos="low",
        state="RUNNING",
        exc_nodes="node7",
        restarts=2,
        gres="gpu:1(IDX:0)",
        nodes="node3",
    )
    assert parse_job("") is None and parse_job("slurm_load_jobs error: Invalid job id specified") is None
    assert parse_job(SHOW_JOB.replace("ExcNodeList=node7", "ExcNodeList=(null)")).exc_nodes == ""


def test_preemptible_by_partition_or_by_qos():
    by_part, by_qos = Preemptible(partitions=("scavenger",)), Preemptible(qos=("low",))
    assert by_part(JobInfo(1, partition="scavenger")) and not by_part(JobInfo(1, partition="normal"))
    assert by_part(JobInfo(1, partition="normal,scavenger"))  # a pending job may name several
    assert by_qos(JobInfo(1, partition="normal", qos="low")) and not by_qos(JobInfo(1, qos=""))


def test_what_a_failed_call_means():
    assert control.classify(0, "") == control.OK
    # An earlier call that timed out did reach Slurm: the job is back in the queue, as wanted.
    assert control.classify(1, "Job is pending execution for job 5") == control.OK
    for text in ("Unable to contact slurm controller (connect failure)", "Socket timed out on send/recv"):
        assert control.classify(1, f"slurm_load_jobs error: {text}") == control.UNREACHABLE
    assert control.classify(1, "scontrol: error: Invalid job id specified") == control.GONE
    assert control.classify(1, "Access/permission denied") == control.FAILED


# ---------------------------------------------------------------------------------------------- decide

G0, G1 = UUIDS[0], UUIDS[1]
JOBS = {7: JobInfo(7, "bob", partition="scavenger"), 8: JobInfo(8, "carol", partition="normal")}
JOBS[9] = JobInfo(9, "dave", partition="scavenger")
YIELD = Preemptible(partitions=("scavenger",))


def use(pid: int, gpus, job=None, user="alice"):
    return Use(pid, user, "python3", frozenset(gpus), job)


def test_a_preemptible_job_yields_to_a_user_and_to_a_normal_job_once():
    job = (use(10, [G0], 7, "bob"), use(11, [G0], 7, "bob"))
    assert decide(job, JOBS, YIELD) == ()  # its own processes
    acts = decide((*job, use(20, [G0])), JOBS, YIELD)
    assert [(a.job, a.gpu, a.by.label) for a in acts] == [(7, G0, "alice python3[20]")]
    assert decide((*job, use(20, [G0])), JOBS, YIELD, done=frozenset({7})) == ()  # once per job
    acts = decide((*job, use(30, [G0], 8, "carol")), JOBS, YIELD)  # a job of another partition
    assert [(a.job, a.by.label) for a in acts] == [(7, "carol python3[30]")]


def test_no_yield_to_another_preemptible_job_an_undescribed_one_or_on_another_gpu():
    job = (use(10, [G0], 7, "bob"),)
    assert decide((*job, use(40, [G0], 9, "dave")), JOBS, YIELD) == ()  # the same tier
    assert decide((*job, use(50, [G0], 99, "erin")), JOBS, YIELD) == ()  # Slurm has not described 99
    assert decide((*job, use(20, [G1])), JOBS, YIELD) == ()  # another GPU
    assert decide((use(30, [G0], 8, "carol"), use(20, [G0])), JOBS, YIELD) == ()  # 8 is not preemptible


# ---------------------------------------------------------------------------------------------- procs


def _spawn(argv, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **kw)


def _child_of(parent: int) -> int:
    def found() -> int:
        for pid in os.listdir("/proc"):
            st = read_stat(int(pid)) if pid.isdigit() else None
            if st is not None and st.ppid == parent:
                return st.pid
        return 0

    return int(wait_for(found, 10, "the child"))  # type: ignore[arg-type]


def _member(pid: int):
    st = read_stat(pid)
    assert st is not None
    return procs.JobMembers().of(pid, st.start_ticks)


def test_a_job_by_its_slurmstepd_ancestor_named_or_by_the_environment(tmp_path):
    stepd = tmp_path / "slurmstepd"  # a root-owned process of that name, as slurmd starts them
    shutil.copy("/bin/sh", stepd)
    env = dict(os.environ, SLURM_JOB_ID="88", SLURMD_NODENAME="node5")
    started = []
    try:
        named = _spawn(["slurmstepd: [77.batch]", "-c", "sleep 600 & wait"], executable=str(stepd))
        plain = _spawn(["slurmstepd", "-c", "sleep 600 & wait"], executable=str(stepd), env=env)
        outside = _spawn(["sleep", "600"], env=env)  # the job's variables, outside any job
        started = [named, plain, outside]
        assert _member(_child_of(named.pid)) == procs.Member(77, "", "slurmstepd")
        assert _member(_child_of(plain.pid)) == procs.Member(88, "node5", "slurmstepd")
        assert _member(outside.pid) is None
        assert _member(os.getpid()) is None
    finally:
        for p in started:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _writable_cgroup_root() -> Path:
    for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup", "/sys/fs/cgroup/pids"):
        if os.path.exists(f"{root}/cgroup.procs") and os.access(root, os.W_OK):
            return Path(root)
    pytest.fail("no writable cgroup hierarchy to make a job's cgroup in (run as root)", pytrace=False)


def test_a_job_by_its_cgroup():
    step = _writable_cgroup_root() / f"gpu-mon-test-{os.getpid()}" / "job_4242" / "step_batch"
    step.mkdir(parents=True)
    p = _spawn(["sleep", "600"])
    try:
        (step / "cgroup.procs").write_text(str(p.pid))
        assert "/job_4242/step_batch" in Path(f"/proc/{p.pid}/cgroup").read_text()
        assert _member(p.pid) == procs.Member(4242, "", "cgroup")
    finally:
        p.kill()
        p.wait()
        wait_for(lambda: not (step / "cgroup.procs").read_text().strip(), 10, "the cgroup to empty")
        for d in (step, step.parent, step.parent.parent):
            d.rmdir()
    assert procs.job_of_cgroup("0::/system.slice/slurmstepd.scope/job_17/step_0/user/task_0\n") == 17
    assert procs.job_of_cgroup("4:memory:/slurm/uid_1000/job_5/step_batch\n1:cpu:/\n") == 5
    assert procs.job_of_cgroup("0::/user.slice/user-1000.slice/session-2.scope\n") is None
    assert procs.job_of_cgroup("0::/system.slice/job_runner.service\n") is None


# ---------------------------------------------------------------------------------------------- a real Slurm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from slurmcluster.running_cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture
def slurm(cluster, sim):
    """The cluster, its jobs cancelled after the test; the simulated GPUs are its GRES devices."""
    for i, dev in enumerate(cluster.devices):
        sim.set(i, device=dev)
    yield cluster
    if "slurmctld" not in cluster.procs:
        cluster.start_ctld()
    cluster.cancel_all()


def _section(**keys: object) -> str:
    base = {"preemptible_partitions": "scavenger", "avoid_node_seconds": 3, "timeout_seconds": 2}
    base.update(keys)
    return "[gpu-all]\ngpus = ALL\n[slurm]\n" + "".join(f"{k} = {v}\n" for k, v in base.items())


def _started(log: Path, restarts: str = "0") -> list:
    return wait_for(lambda: [e for e in events(log) if e[0] == "start" and e[2] == restarts], 30, "the job")


def _described(d, job: int, gpu: int, preemptible: bool) -> dict:
    def found():
        for j in (d.state().get("gpus") or [{}] * 2)[gpu].get("slurm_jobs", []):
            if j["id"] == job and j["preemptible"] is preemptible:
                return j
        return None

    return wait_for(found, 20, f"job {job} in status on GPU {gpu}")  # type: ignore[return-value]


# Why a Slurm job's GPU is busy: its process holds it, or (read every few seconds) Slurm has allocated it.
HOLDS = r"root python3\[\d+\] holds .*"


def _opener(path: str) -> subprocess.Popen:
    p = subprocess.Popen(foreign_opener_cmd(path), stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "open"
    return p


def _stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()


def test_a_scavenger_job_is_requeued_when_someone_opens_its_gpu_and_avoids_the_node(
    slurm, daemon_factory, tmp_path
):
    log = tmp_path / "job.log"
    job = slurm.submit("scavenger", 0, log)
    _started(log)
    prom = tmp_path / "gpu_mon.prom"
    d = daemon_factory(_section() + f"[metrics]\ntextfile = {prom}\n", env=slurm.env)
    entry = _described(d, job, 0, True)
    assert (entry["user"], entry["partition"]) == ("root", "scavenger")
    assert (
        "Slurm job"
        in subprocess.run(
            [sys.executable, "-m", "gpu_mon", "--config", str(d.config_path), "status"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    opener = _opener(slurm.devices[0])
    try:
        who = rf"slurm: root python3\[{opener.pid}\] on GPU 0 "
        d.wait_log(who + rf".*which job {job} holds \(root, partition scavenger\): requeueing it")
        d.wait_log(rf"slurm: job {job}: requeue done \(issued [\d.]+ ms after the open")
        requeued = time.monotonic()
        wait_for(lambda: slurm.job(job).get("Restarts") == "1", 20, "Restarts=1")
        wait_for(lambda: [e for e in events(log) if e[0] == "term"], 20, "Slurm's SIGTERM in the job")
        pending = ("PENDING", "localhost")  # (COMPLETING for a moment after the requeue)
        wait_for(
            lambda: (slurm.job(job)["JobState"], slurm.job(job)["ExcNodeList"]) == pending, 20, "pending"
        )
        # Slurm may start it at once (no waiting for its begin time): it does not, on this node.
        slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        _stop(opener)
        back = _started(log, "1")[0]
        assert int(back[3]) / 1e9 >= requeued + 3 - 0.5, "started again within avoid_node_seconds"
        assert slurm.job(job)["ExcNodeList"] == "(null)"  # its own list again
    finally:
        _stop(opener)
    assert len(d.wait_log(r"requeueing it")) == 1  # once
    assert len([e for e in events(log) if e[0] == "start"]) == 2
    metrics = d.state().get("slurm") or {}
    assert {"action": "requeue", "result": "ok", "count": 1} in metrics.get("calls", [])
    sample = 'gpu_mon_slurm_actions_total{action="requeue",result="ok"} 1.0'
    wait_for(lambda: prom.exists() and sample in prom.read_text(), 10, "the metric in the textfile")
    assert "gpu_mon_slurm_unreachable 0.0" in prom.read_text()
    assert d.stop() == 0  # (the history is written at the latest when the daemon stops)
    with contextlib.closing(sqlite3.connect(tmp_path / "history.sqlite")) as db:
        rows = db.execute("SELECT uuid, workload, who, detected_by FROM preemptions").fetchall()
    assert rows == [
        (UUIDS[0], f"Slurm job {job} (root, scavenger): requeue", f"root python3[{opener.pid}]", "open")
    ]


def test_with_a_signal_the_job_checkpoints_before_the_requeue(slurm, daemon_factory, tmp_path):
    log = tmp_path / "job.log"
    job = slurm.submit("scavenger", 0, log)
    _started(log)
    d = daemon_factory(_section(signal="USR1", signal_grace_seconds=1, avoid_node_seconds=600), env=slurm.env)
    _described(d, job, 0, True)
    opener = _opener(slurm.devices[0])
    try:
        d.wait_log(rf"which job {job} holds .*: signalling it")
        d.wait_log(rf"slurm: job {job}: signal done")
        d.wait_log(rf"slurm: job {job}: requeue done")
        wait_for(lambda: slurm.job(job).get("Restarts") == "1", 20, "Restarts=1")

        def both() -> list:
            found = [e for e in events(log) if e[0] in ("usr1", "term")]
            return found if len(found) >= 2 else []

        seen = wait_for(both, 20, "usr1, then term")
    finally:
        _stop(opener)
    assert [e[0] for e in seen] == ["usr1", "term"]  # the checkpoint first
    assert (int(seen[1][-1]) - int(seen[0][-1])) / 1e9 >= 0.9  # then the grace
    assert len(d.wait_log(rf"which job {job} holds")) == 1
    # gpu-mon stops within avoid_node_seconds: the job gets its own excluded nodes back at once.
    wait_for(lambda: slurm.job(job).get("ExcNodeList") == "localhost", 20, "the exclusion")
    assert d.stop() == 0
    assert slurm.job(job)["ExcNodeList"] == "(null)"
    d.wait_log(rf"slurm: job {job} may use this node again")


def test_a_normal_job_stops_our_workload_and_leaves_the_scavenger_job_alone(slurm, daemon_factory, tmp_path):
    scav_log, normal_log = tmp_path / "scav.log", tmp_path / "normal.log"
    scav = slurm.submit("scavenger", 0, scav_log)
    _started(scav_log)
    body = _section() + f"[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = 1\nuser = root\n"
    d = daemon_factory(body, env=slurm.env)
    d.wait_running("miner")
    _described(d, scav, 0, True)
    normal = slurm.submit("normal", 1, normal_log)
    _started(normal_log)
    d.wait_log(rf"GPU 1 .*busy: ({HOLDS}|Slurm has allocated it to job {normal} of root); stopping miner")
    _described(d, normal, 1, False)
    wait_for(lambda: d.workload("miner").get("state") not in ("running", "stopping"), 20, "the miner gone")
    assert slurm.job(scav)["JobState"] == "RUNNING" and slurm.job(scav)["Restarts"] == "0"
    assert "requeueing it" not in d.log()
    assert not re.search(r"slurm: job \d+", d.log())


def test_slurmctld_stopped_one_line_no_crash_and_the_action_once_it_is_back(slurm, daemon_factory, tmp_path):
    log = tmp_path / "job.log"
    job = slurm.submit("scavenger", 0, log)
    _started(log)
    d = daemon_factory(_section(timeout_seconds=1), env=slurm.env)
    _described(d, job, 0, True)
    slurm.stop_ctld()
    opener = _opener(slurm.devices[0])
    try:
        d.wait_log(r"slurm: cannot reach Slurm")

        def tries() -> int:
            calls = (d.state().get("slurm") or {}).get("calls", [])
            return sum(c["count"] for c in calls if c["result"] == "unreachable")

        wait_for(lambda: tries() >= 3, 30, "three tries")
        assert d.proc is not None and d.proc.poll() is None
        assert len(d.wait_log(r"slurm: cannot reach Slurm")) == 1  # one line for the episode
        assert (d.state().get("slurm") or {}).get("unreachable") is True
        slurm.start_ctld()
        d.wait_log(rf"slurm: job {job}: requeue done")
        d.wait_log(r"slurm: Slurm answers again")
        wait_for(lambda: slurm.job(job).get("Restarts") == "1", 20, "Restarts=1")
    finally:
        _stop(opener)
    assert len(d.wait_log(r"slurm: cannot reach Slurm")) == 1
    assert not [e for e in events(log) if e[0] == "usr1"]


def test_check_verifies_the_commands_the_partitions_and_says_what_it_cannot(slurm, sim, tmp_path):
    def check(section: str) -> subprocess.CompletedProcess:
        path = tmp_path / "check.conf"
        path.write_text(f"[defaults]\nstate_file = {tmp_path / 'state.json'}\n" + section)
        os.chmod(path, 0o600)
        argv = [sys.executable, "-m", "gpu_mon", "--config", str(path), "--sim", str(sim.path), "check"]
        return subprocess.run(argv, capture_output=True, text=True, env=slurm.env, timeout=60)

    good = check(_section())
    assert good.returncode == 0, good.stderr
    bad = check(_section(preemptible_partitions="scavenger, nosuch", scancel="/nonexistent/scancel"))
    assert bad.returncode == 2
    assert "[slurm] preemptible_partitions: Slurm has no partition 'nosuch'" in bad.stderr
    assert "[slurm] scancel: '/nonexistent/scancel' is not found" in bad.stderr
    assert "scavenger'" not in bad.stderr
    qos = check(_section(preemptible_qos="low"))  # no accounting here: said, not an error
    assert qos.returncode == 0 and "[slurm] preemptible_qos: cannot list Slurm's QOS" in qos.stderr


def test_our_workload_yields_to_a_scavenger_job_which_does_not_yield_to_it(slurm, daemon_factory, tmp_path):
    # It holds GPU 0 and ignores SIGTERM: still there for 2 s after the job's open, long after Slurm has
    # described the job (a requeue for its sake would come in that time).
    cmd = workload_cmd(tmp_path, "--hold", slurm.devices[0], "--ignore-term")
    miner = f"[process-miner]\ncmd = {cmd}\ngpus = 0\nuser = root\nurgent_stop_timeout_seconds = 2\n"
    body = _section() + miner
    d = daemon_factory(body, env=slurm.env)
    d.wait_running("miner")
    log = tmp_path / "job.log"
    job = slurm.submit("scavenger", 0, log)
    _started(log)
    d.wait_log(rf"GPU 0 .*busy: ({HOLDS}|Slurm has allocated it to job {job} of root); stopping miner")
    _described(d, job, 0, True)
    wait_for(lambda: d.workload("miner").get("state") not in ("running", "stopping"), 20, "the miner gone")
    d.wait_log(r"miner\[\d+\] .*SIGKILL")  # (it held GPU 0 for its whole grace)
    assert slurm.job(job)["JobState"] == "RUNNING" and slurm.job(job)["Restarts"] == "0"
    assert "requeueing it" not in d.log()  # gpu-mon's own workload is not someone else's use
