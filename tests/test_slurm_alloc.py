"""[slurm]: a GPU that Slurm has allocated to a job is that job's before its processes open it.

The pure parts (what `scontrol show job -d -o` says, gres.conf, index -> UUID) with hostile and odd texts;
then a real one-node Slurm (slurmcluster.py) with gpu-mon on simulated GPUs that are its GRES devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace as dataclasses_replace

import pytest
from conftest import UUIDS, wait_for, workload_cmd
from test_policy import RULES, U0, U1, config, gpu, snap
from test_slurm import _section, cluster, slurm  # noqa: F401  (the real Slurm's fixtures)

from gpu_mon.api.model import Running, SlurmJob
from gpu_mon.config import SlurmSection
from gpu_mon.policy import decide as policy
from gpu_mon.policy import gpustate, words
from gpu_mon.policy.decisions import Busy, PolicyState, Stop, Verdict
from gpu_mon.slurm import alloc as A
from gpu_mon.slurm.preempt import Slurm

# One line per job, as Debian's Slurm 22.05 prints `scontrol show job -d -o` (shortened).
RUNNING = (
    "JobId=42 JobName=train UserId=alice(1001) GroupId=alice(1001) JobState=RUNNING Reason=None "
    "NodeList=node3 BatchHost=node3 JOB_GRES=gpu:1 Nodes=node3 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:1) "
    "Partition=normal Command=/home/alice/run it.sh TresPerNode=gres:gpu:1"
)


@pytest.mark.parametrize(
    "gres, want",
    [
        ("gpu:1(IDX:1)", (1,)),
        ("gpu:3(IDX:0-1,3)", (0, 1, 3)),
        ("gpu:a100:2(IDX:2-3)", (2, 3)),
        ("gpu(IDX:0)", (0,)),  # (older Slurm)
        ("gpu:a100:1(IDX:0),gpu:v100:1(IDX:4)", (0, 4)),
        ("mps:50(0/100),gpu:1(IDX:2)", (2,)),
        ("", ()),
        ("(null)", ()),
        ("mps:100", ()),
        ("gpu:0", ()),
        ("gpu:1", None),  # GPUs, but not which: unknown
        ("gpu:1(IDX:N/A)", None),
        ("gpu:1(IDX:5-2)", None),
        ("gpu:1(IDX:0-99999999)", None),
    ],
)
def test_a_nodes_gres_words_give_its_gpu_indices(gres, want):
    assert A.indices(gres) == want


def test_hostlists_and_device_ranges_expand():
    assert A.expand("node[01-03,7],gpu5") == ["node01", "node02", "node03", "node7", "gpu5"]
    assert A.expand("/dev/nvidia[0-1]") == ["/dev/nvidia0", "/dev/nvidia1"]
    for bad in ("node[1-", "n[a-b]", "n]", "n[0-99999999]"):
        with pytest.raises(ValueError):
            A.expand(bad)


def test_running_jobs_allocations_by_node():
    two_nodes = (
        "JobId=43 UserId=bob(1002) JobState=RUNNING NodeList=node[4-5] "
        "Nodes=node4 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1) Nodes=node5 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:3)"
    )
    pending = "JobId=44 UserId=carol(1003) JobState=PENDING NodeList=(null)"
    done = RUNNING.replace("JobId=42", "JobId=45").replace("RUNNING", "COMPLETED")
    no_gres = "JobId=46 UserId=dave(1004) JobState=RUNNING Nodes=node3 CPU_IDs=0 Mem=0 GRES="
    got = A.parse_allocations("\n".join((RUNNING, two_nodes, pending, done, no_gres, "garbage=1", "")))
    assert got == (
        A.Allocated(42, "alice", "node3", (1,)),
        A.Allocated(43, "bob", "node4", (0, 1)),
        A.Allocated(43, "bob", "node5", (3,)),
    )
    same = "JobId=47 UserId=e(1) JobState=SUSPENDED Nodes=n[1-2] CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:0)"
    assert [(a.node, a.indices) for a in A.parse_allocations(same)] == [("n1", (0,)), ("n2", (0,))]
    assert A.parse_allocations("slurm_load_jobs error: Unable to contact slurm controller") == ()


def test_a_job_name_can_only_make_more_gpus_taken():
    # A name that says PENDING does not hide the running job's GPU (every JobState word is read) ...
    hiding = RUNNING.replace("JobName=train", "JobName=x JobState=PENDING")
    assert [a.indices for a in A.parse_allocations(hiding)] == [(1,)]
    # ... and one that imitates a detail adds a GPU, never removes the real one.
    adding = RUNNING.replace("JobName=train", "JobName=x Nodes=node3 GRES=gpu:1(IDX:0)")
    assert sorted(a.indices for a in A.parse_allocations(adding)) == [(0,), (1,)]


GRES_CONF = """\
# the lab's GPUs
AutoDetect=off
NodeName=node[3-4] Name=gpu Type=a100 File=/dev/nvidia[0-1]  # two each
NodeName=node3 Name=gpu File=/dev/nvidia2
nodename=node9 name=mps Count=100
"""


def test_gres_conf_gives_each_nodes_gpu_files_in_order():
    conf = A.parse_gres_conf(GRES_CONF)
    assert conf.files("node3") == ("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2")
    assert conf.files("node4") == ("/dev/nvidia0", "/dev/nvidia1") and conf.files("node9") == ()
    assert conf.problem == ""
    anywhere = A.parse_gres_conf("Name=gpu File=/dev/nvidia[0-1]\n")
    assert anywhere.files("any") == ("/dev/nvidia0", "/dev/nvidia1")
    assert "AutoDetect=nvml" in A.parse_gres_conf("AutoDetect=nvml\nName=gpu Count=2\n").problem
    assert "without File=" in A.parse_gres_conf("NodeName=n Name=gpu Count=2\n").problem
    assert "cannot read" in A.read_gres_conf("/nonexistent/gres.conf").problem
    assert A.gres_conf_path({"SLURM_CONF": "/x/slurm.conf"}) == "/x/gres.conf"
    assert A.gres_conf_path({}) == "/etc/slurm/gres.conf"


def test_an_index_is_mapped_to_this_hosts_gpu_by_its_device_node():
    ids = {"/dev/nvidia0": (195, 0), "/dev/nvidia1": (195, 1), "/dev/nvidia2": (195, 2)}
    gpu_ids = {(195, 1): UUIDS[1], (195, 2): UUIDS[0]}
    conf = A.parse_gres_conf(GRES_CONF)
    allocs = (*A.parse_allocations(RUNNING), A.Allocated(50, "bob", "node3", (2,)))
    allocs += (A.Allocated(51, "carol", "node4", (1,)),)  # another host's GPU 1: the same path
    got, problems = A.mapped(allocs, conf, {"node3"}, gpu_ids, ids.get)
    assert got == {UUIDS[1]: (42, "alice"), UUIDS[0]: (50, "bob")} and problems == []
    # An index gres.conf does not have, or a device node that is none of this host's GPUs: said.
    got, problems = A.mapped((A.Allocated(52, "d", "node3", (0, 7)),), conf, {"node3"}, gpu_ids, ids.get)
    assert got == {} and len(problems) == 2 and "GPU index 7" in problems[1]
    got, problems = A.mapped((A.Allocated(53, "d", "node3", None),), conf, {"node3"}, gpu_ids, ids.get)
    assert got == {} and "does not say which GPUs" in problems[0]
    # Several slurmd on one host: a node whose device nodes no other node names is this host's.
    conf2 = A.parse_gres_conf("NodeName=nodea Name=gpu File=/d/a0\nNodeName=nodeb Name=gpu File=/d/b0\n")
    ids2 = {"/d/a0": (1, 10), "/d/b0": (1, 11)}
    got, _ = A.mapped((A.Allocated(54, "e", "nodeb", (0,)),), conf2, set(), {(1, 11): UUIDS[1]}, ids2.get)
    assert got == {UUIDS[1]: (54, "e")}


def test_node_name_is_this_host_alone_and_turns_the_guess_off():
    assert A.this_node("gpu03", "host", ["nodea"]) == ({"gpu03"}, False)
    assert A.this_node(None, "host", ["nodea", ""]) == ({"host", "nodea"}, True)
    # gres.conf would take nodeb for this host (its device node is no other node's): not with node_name.
    conf = A.parse_gres_conf("NodeName=nodea Name=gpu File=/d/a0\nNodeName=nodeb Name=gpu File=/d/b0\n")
    ids = {"/d/a0": (1, 10), "/d/b0": (1, 11)}.get
    gpu_ids = {(1, 10): UUIDS[0], (1, 11): UUIDS[1]}
    allocs = (A.Allocated(54, "e", "nodeb", (0,)), A.Allocated(55, "f", "nodea", (0,)))
    here, guess = A.this_node("nodea", "host", ["nodeb"])
    assert A.mapped(allocs, conf, here, gpu_ids, ids, guess) == ({UUIDS[0]: (55, "f")}, [])


def test_identity_is_a_char_devices_numbers_or_a_files_inode(tmp_path):
    f = tmp_path / "stand-in"
    f.write_text("")
    st = os.stat(f)
    assert A.identity(str(f)) == (st.st_dev, st.st_ino)
    assert A.identity("/dev/null") == (os.stat("/dev/null").st_rdev,)
    assert A.identity(str(tmp_path / "nothing")) is None


# ---------------------------------------------------------------------------------------------- the policy


def test_an_allocated_gpu_is_busy_and_a_workload_there_yields_at_once():
    s = snap(slurm_jobs=(SlurmJob(42, "alice", (U1,)),))
    busy, reasons = policy.gpu_verdict(U1, RULES, s, {})
    assert busy and [(r.kind, r.job) for r in reasons] == [(Busy.SLURM_JOB, 42)]
    assert words.reason(reasons[0]) == "Slurm has allocated it to job 42 of alice"
    assert not policy.gpu_verdict(U0, RULES, s, {})[0]
    assert gpustate.gpu_state(Verdict(U1, True, tuple(reasons)), None, False)[0] == "foreign"
    c = config()
    plan = policy.resolve(c, s.reading.gpus)
    d = policy.decide(c, plan, dataclasses_replace(s, running=(Running("m", 900, 50.0),)), PolicyState())
    assert [a.key for a in d.actions if isinstance(a, Stop)] == ["m"]  # (urgent: a foreign reason)
    # Not read yet: every GPU is busy until Slurm's first answer.
    unknown = snap(slurm_unknown="no answer from scontrol yet")
    assert [r.kind for r in policy.gpu_verdict(U0, RULES, unknown, {})[1]] == [Busy.SLURM_UNKNOWN]


# ---------------------------------------------------------------------------------------------- a real Slurm


def _allocated_entry(d, job: int, gpu: int, described: bool = False):
    """The job's entry on the GPU in the state, once Slurm's allocation shows it (`described`: and the
    job's lookup has answered too, a round or more later)."""
    for j in (d.state().get("gpus") or [{}] * 2)[gpu].get("slurm_jobs", []):
        if j["id"] == job and j.get("allocated") and (j.get("partition") or not described):
            return j
    return None


def test_a_job_allocated_a_gpu_it_has_not_opened_keeps_our_workload_off_it(
    slurm,  # noqa: F811
    daemon_factory,
    tmp_path,
):
    body = _section() + f"[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = 0\nuser = root\n"
    d = daemon_factory(body, env=slurm.env)
    d.wait_running("miner")
    # A normal job given one GPU (Slurm's first free one: index 0, GPU 0) that sleeps without opening it.
    r = slurm.run(
        "sbatch", "--parsable", "--partition=normal", "--gres=gpu:1", f"--chdir={slurm.dir}",
        f"--output={slurm.dir / 'jobs' / 'slurm-%j.out'}", "--wrap=exec sleep 600",
    )  # fmt: skip
    job = int(r.stdout.strip().split(";")[0])
    wait_for(lambda: slurm.job(job).get("JobState") == "RUNNING", 30, "the job running")
    assert "IDX:0" in slurm.job(job)["GRES"], slurm.job(job)
    d.wait_log(rf"GPU 0 .*busy: Slurm has allocated it to job {job} of root; stopping miner")
    entry = wait_for(lambda: _allocated_entry(d, job, 0, True), 20, f"job {job} on GPU 0 described")
    assert entry["user"] == "root" and entry["partition"] == "normal" and entry["preemptible"] is False
    wait_for(lambda: d.workload("miner").get("state") not in ("running", "stopping"), 20, "the miner gone")
    status = subprocess.run(
        [sys.executable, "-m", "gpu_mon", "--config", str(d.config_path), "status"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert f"Slurm has allocated it to job {job} of root" in status
    assert f"Slurm job {job} root, partition normal, not preemptible, allocated by Slurm" in status
    assert _allocated_entry(d, job, 1) is None
    slurm.run("scancel", str(job))
    d.wait_running("miner", timeout=40)  # back once the job has ended
    assert "cannot tell which GPU Slurm allocated" not in d.log()


# ---------------------------------------------------------------------------------------------- the hook


def _hook(tmp_path, monkeypatch, **keys):
    """The daemon's Slurm hook on two stand-in GPUs, gres.conf giving one to node gpu03 and one to node
    other; its scontrol a script that logs each call and prints job 42 on gpu03 and 43 on other."""
    devices = [tmp_path / "nvidia0", tmp_path / "nvidia1"]
    for d in devices:
        d.write_text("")
    (tmp_path / "gres.conf").write_text(
        f"NodeName=gpu03 Name=gpu File={devices[0]}\nNodeName=other Name=gpu File={devices[1]}\n"
    )
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    (tmp_path / "jobs").write_text(
        RUNNING.replace("IDX:1", "IDX:0").replace("node3", "gpu03")
        + "\n"
        + RUNNING.replace("JobId=42", "JobId=43").replace("IDX:1", "IDX:0").replace("node3", "other")
        + "\n"
    )
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls"}\ncat {tmp_path / "jobs"}\n')
    scontrol.chmod(0o755)
    rule = SlurmSection(preemptible_qos=("low",), scontrol=str(scontrol), **keys)
    hook = Slurm(rule, lambda: None, time.monotonic, time.time)
    gpus = (gpu(0, U0, device=str(devices[0])), gpu(1, U1, device=str(devices[1])))
    return hook, snap(gpus=gpus)


def _allocated(hook, s):
    """Rounds until the allocations are read: {UUID: job}."""

    def read():
        hook.round(s, {}, {}, 0.0, False)
        jobs, unknown = hook.allocations()
        return None if unknown else {g: j.job for j in jobs for g in j.gpus} or None

    return wait_for(read, 20, "Slurm's allocations read")


def test_node_name_alone_names_this_host_in_slurms_allocations(tmp_path, monkeypatch):
    guessed, s = _hook(tmp_path, monkeypatch)
    assert _allocated(guessed, s) == {U0: 42, U1: 43}  # (each node's device node is no other's: both)
    hook, s = _hook(tmp_path, monkeypatch, node_name="gpu03")
    assert _allocated(hook, s) == {U0: 42}
    assert hook.node == "gpu03" and hook._node(42, U0) == "gpu03"
    hook.set_rule(dataclasses_replace(hook.rule, node_name="other"))  # a reload: read again at once
    wait_for(lambda: _allocated(hook, s) == {U1: 43}, 20, "the allocations of node other")


def test_allocation_seconds_0_reads_nothing_until_a_reload_turns_it_on(tmp_path, monkeypatch):
    hook, s = _hook(tmp_path, monkeypatch, allocation_seconds=0)
    for _ in range(3):
        hook.round(s, {}, {}, 0.0, False)
    assert not hook.control.busy() and not (tmp_path / "calls").exists()
    assert hook.allocations() == ((), "") and hook.next_wake() is None  # (no GPU busy for want of it)
    hook.set_rule(dataclasses_replace(hook.rule, allocation_seconds=5))
    assert hook.allocations() == ((), "no answer from scontrol yet")
    assert _allocated(hook, s) == {U0: 42, U1: 43}
    assert "show job -d -o" in (tmp_path / "calls").read_text()
    hook.set_rule(dataclasses_replace(hook.rule, allocation_seconds=0))
    assert hook.allocations() == ((), "") and hook.next_wake() is None
