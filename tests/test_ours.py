"""What is "ours": a workload's (or a queue job's) process, on the GPUs that workload was given, and nothing
else. Its hold of another GPU's node (or a context there) is someone else's use of that GPU, as any
process's is (holder_grace_seconds lets an admin discount holders NVML does not show). A process in no
workload (a hook's setsid'd child, reparented to the daemon, a child subreaper) is ours on none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import WORKLOAD_PYTHON, Daemon, SimHost, wait_for, workload_cmd
from test_queue import JOB, PY, Lab, made_lab, queue_body

from gpu_mon.api.observe import Observer
from gpu_mon.api.sim import SimBackend
from gpu_mon.outputs import status

# Opens a GPU's node and keeps it: TARGET a path, or `other:U0=P0,U1=P1` (the node of the GPU that is not
# in its CUDA_VISIBLE_DEVICES); once TRIGGER exists ("-": at once); says `PID PATH` in REPORT.
OPENER = r"""
import os, sys, time
report, target, trigger = sys.argv[1:4]
if target.startswith("other:"):
    paths = dict(x.split("=", 1) for x in target[len("other:"):].split(","))
    target = [p for u, p in paths.items() if u != os.environ.get("CUDA_VISIBLE_DEVICES")][0]
while trigger != "-" and not os.path.exists(trigger):
    time.sleep(0.05)
node = open(target)
with open(report, "a") as f:
    f.write(f"{os.getpid()} {target}\n")
time.sleep(600)
"""


def opener(directory: Path) -> Path:
    script = directory / "opener.py"
    script.write_text(OPENER)
    os.chmod(script, 0o755)
    return script


def opened(report: Path) -> Dict[int, str]:
    """{pid: path} of the openers that have opened their node."""
    try:
        lines = report.read_text().splitlines()
    except OSError:
        return {}
    return {int(pid): path for pid, path in (line.split(" ", 1) for line in lines if " " in line)}


def holders(d: Daemon, index: int) -> Dict[int, dict]:
    gpus = d.state().get("gpus") or []
    return {h["pid"]: h for h in gpus[index]["holders"]} if len(gpus) > index else {}  # type: ignore[index]


def gpu_state(d: Daemon, index: int) -> dict:
    return d.state()["gpus"][index]  # type: ignore[index]


def device_holders_line(d: Daemon, index: int) -> str:
    text = status.render(d.state())
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith(f"GPU {index} ")]
    assert at, text
    return next(line for line in lines[at[0] :] if "device holders:" in line)


def test_a_workload_given_gpu_0_that_opens_gpu_1_makes_gpu_1_busy_and_ours_there_yields(
    tmp_path, sim, daemon_factory
):
    script, report, trigger = opener(tmp_path), tmp_path / "opened", tmp_path / "go"
    body = (
        "[gpu-all]\ngpus = ALL\n\n"
        f"[process-a]\ncmd = {WORKLOAD_PYTHON} {script} {report} {sim.device(1)} {trigger}\ngpus = 0\n"
        "user = root\n\n"
        f"[process-b]\ncmd = {workload_cmd(tmp_path)}\ngpus = 1\nuser = root\n"
    )
    d = daemon_factory(body)
    d.wait_running("a")
    d.wait_running("b")
    trigger.touch()
    pid = int(wait_for(lambda: next(iter(opened(report)), 0), 20, "a's process opened GPU 1's node"))  # type: ignore[arg-type]
    # Its hold of GPU 1's node is someone else's use of GPU 1, as any process's would be: b yields.
    # Before: a's process counted as ours on every GPU, and b ran on.
    d.wait_log(rf"\[{pid}\].*; stopping b", timeout=10)
    wait_for(lambda: d.workload("b").get("state") not in ("running", "stopping"), 20, "b stopped")
    d.poll_passed()
    assert d.workload("b")["state"] not in ("running", "stopping", "starting"), d.workload("b")
    assert d.workload("a")["state"] == "running"
    assert "(ours elsewhere)" in device_holders_line(d, 1)
    # A context of it there is someone else's too.
    sim.set(1, processes=[{"pid": pid, "used_memory_mib": 900}], memory_used_mib=900)
    d.poll_passed()
    g1 = gpu_state(d, 1)
    assert g1["busy"] and holders(d, 1)[pid]["ours"] is False, g1
    assert [p for p in g1["nvml_processes"] if p["pid"] == pid and not p["ours"]], g1
    assert "(ours)" not in device_holders_line(d, 1)
    assert pid not in holders(d, 0)


def test_a_process_of_the_daemon_in_no_workload_is_not_ours(tmp_path, sim):
    # Deterministic, at the observer: a child of "the daemon" (this test's process) that is in no
    # workload, as a hook's setsid'd child reparented to the daemon is; and a workload's process on a GPU it
    # was given and on one it was not.
    backend = SimBackend(str(sim.path))
    observer = Observer(backend, own_pid=os.getpid())
    observer.read_gpus()
    code = (
        "import sys, time; fs = [open(p) for p in sys.argv[1:]]; print('open', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, sim.device(0), sim.device(1)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "open\n"
        observer.scan("full", {})
        (h,) = [h for h in observer.holders if h.pid == child.pid]
        assert not h.ours and not h.ours_on(sim.uuid(0)) and not h.ours_on(sim.uuid(1))  # before: ours
        assert not h.in_workload
        # now as the leader of a workload given GPU 0: ours there, someone else's on GPU 1
        observer.scan("full", {child.pid: (sim.uuid(0),)}, every=True)
        (h,) = [h for h in observer.holders if h.pid == child.pid]
        assert not h.ours and h.ours_on(sim.uuid(0)) and not h.ours_on(sim.uuid(1)) and h.in_workload
        observer.scan("full", {child.pid: (sim.uuid(0), sim.uuid(1))}, every=True)
        (h,) = [h for h in observer.holders if h.pid == child.pid]
        assert h.ours and h.ours_on(sim.uuid(1))
    finally:
        child.kill()
        child.wait()


# ----------------------------------------------------------------------------------------- the queue


@pytest.fixture
def ours_lab(sim: SimHost):
    """Two users; the sim's device stand-ins moved where they can open them (the lab's directory)."""
    if os.geteuid() != 0:
        pytest.skip("creates users and runs jobs as them: needs root")
    with made_lab("gmo", ("gmoalice", "gmobob"), JOB) as made:
        for i in range(2):
            node = made.dir / f"nvidia{i}"
            node.touch()
            os.chmod(node, 0o644)
            sim.set(i, device=str(node))
        yield made


def _their_jobs(lab: Lab, user, state: str) -> List[dict]:
    return [j for j in lab.jobs(user).values() if j["state"] == state]


def _reason(lab: Lab, user, job_id: int) -> str:
    return str(lab.jobs(user)[job_id].get("reason", ""))


def test_a_job_given_one_gpu_that_opens_the_other_keeps_another_users_job_off_it(
    ours_lab: Lab, sim, daemon_factory
):
    lab = ours_lab
    script, report = opener(lab.dir), lab.dir / "opened"
    report.touch()
    os.chmod(report, 0o666)
    nodes = ",".join(f"{sim.uuid(i)}={lab.dir / f'nvidia{i}'}" for i in range(2))
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.submit(lab.alice, "--", PY, str(script), str(report), f"other:{nodes}", "-", lab.marker)
    lab.wait_state(lab.alice, a, "running")
    pid, path = wait_for(lambda: next(iter(opened(report).items()), None), 20, "the job opened the other GPU")  # type: ignore[misc]
    other = 0 if path.endswith("nvidia0") else 1
    d.poll_passed()  # (its hold of the other GPU's node alone: no context there)
    b = lab.submit(lab.bob, "--", PY, str(lab.job), "forever", lab.marker)
    # Before: alice's process counted as ours on GPU `other` too, and bob's job started there.
    wait_for(lambda: f"GPU {other} busy: gmoalice" in _reason(lab, lab.bob, b), 20, "bob's job waits")
    d.poll_passed()
    assert lab.jobs(lab.bob)[b]["state"] == "queued", lab.jobs(lab.bob)[b]
    assert holders(d, other)[pid]["ours"] is False
    assert "(ours)" not in device_holders_line(d, other)


def test_a_hooks_process_is_not_ours(ours_lab: Lab, sim, daemon_factory):
    """A hook runs under a leader of its own, in no workload: a process of it (a setsid'd one too) that
    opens a GPU is someone else's use of that GPU (before: every descendant of the daemon was ours)."""
    lab = ours_lab
    script, report = opener(lab.dir), lab.dir / "opened"
    report.touch()
    os.chmod(report, 0o666)
    node1 = lab.dir / "nvidia1"
    body = (
        queue_body(lab, gpus="0") + f"\n[process-b]\ncmd = {workload_cmd(lab.dir)}\ngpus = 1\nuser = root\n"
    )
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    d.wait_running("b")
    hook = f"setsid {PY} {script} {report} {node1} - {lab.marker} </dev/null >/dev/null 2>&1; sleep 60"
    a = lab.submit(lab.alice, "--notify", hook, "--", PY, str(lab.job), "exit", "0", lab.marker)
    lab.wait_state(lab.alice, a, "done")
    pid = int(wait_for(lambda: next(iter(opened(report)), 0), 20, "the hook's process opened GPU 1"))  # type: ignore[arg-type]
    d.wait_log(rf"\[{pid}\] holds .*nvidia1; stopping b", timeout=10)
    wait_for(lambda: d.workload("b").get("state") not in ("running", "stopping"), 20, "b stopped")
    assert holders(d, 1)[pid]["ours"] is False
    assert "(ours)" not in device_holders_line(d, 1)
