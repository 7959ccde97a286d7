"""[slurm] on a real two-node Slurm: `nodea` and `nodeb`, two slurmd on this host (slurmcluster.py), one
GRES GPU each; simulated GPU 0 is nodea's, GPU 1 nodeb's. gpu-mon watches both (the sensor of each node).

A requeued scavenger job runs again on the other node within seconds (gpu-mon makes it eligible at once:
Slurm alone waits ~2 minutes); it is kept off its first node for avoid_node_seconds; a normal job is never
touched; a gpu-mon killed between its hold and its release releases the job when it starts again.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from conftest import foreign_opener_cmd, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurmcluster
from slurmcluster import events

NODES = ("nodea", "nodeb")


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory):
    yield from slurmcluster.running_cluster(tmp_path_factory.mktemp("slurm2"), gpus=1, nodes=NODES)


@pytest.fixture
def slurm2(cluster2, sim):
    """The two-node cluster, its jobs cancelled after the test; simulated GPU i is node i's GRES device."""
    for i, dev in enumerate(cluster2.devices):
        sim.set(i, device=dev)
    yield cluster2
    cluster2.cancel_all()


def _section(**keys: object) -> str:
    base = {"preemptible_partitions": "scavenger", "timeout_seconds": 2}
    base.update(keys)
    return "[gpu-all]\ngpus = ALL\n[slurm]\n" + "".join(f"{k} = {v}\n" for k, v in base.items())


def _runs(log: Path) -> List[Tuple[str, str, int]]:
    """(restart count, node, CLOCK_MONOTONIC ns) of each start of the job."""
    out, node = [], ""
    for e in events(log):
        if e[0] == "node":
            node = e[2]
        elif e[0] == "start":
            out.append((e[2], node, int(e[-1])))
    return out


def _run(log: Path, restarts: str, timeout: float = 30) -> Tuple[str, str, int]:
    """The job's start with this restart count, waited for."""

    def found() -> Optional[Tuple[str, str, int]]:
        return next((r for r in _runs(log) if r[0] == restarts), None)

    return wait_for(found, timeout, f"the job's start #{restarts}")  # type: ignore[return-value]


def _described(d, job: int, gpu: int, preemptible: bool) -> None:
    def found() -> bool:
        gpus = d.state().get("gpus") or [{}, {}]
        return any(
            j["id"] == job and j["preemptible"] is preemptible for j in gpus[gpu].get("slurm_jobs", [])
        )

    wait_for(found, 20, f"job {job} in status on GPU {gpu}")


def _opener(path: str):
    import subprocess

    p = subprocess.Popen(foreign_opener_cmd(path), stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "open"
    return p


def _stop(p) -> None:
    p.kill()
    p.wait()


def test_a_requeued_job_runs_on_the_other_node_at_once(slurm2, daemon_factory, tmp_path):
    log = tmp_path / "job.log"
    job = slurm2.submit("scavenger", 0, log)
    _r, first, _t = _run(log, "0")
    other = NODES[1 - NODES.index(first)]
    d = daemon_factory(_section(), env=slurm2.env)  # avoid_node_seconds at its default, 600
    _described(d, job, NODES.index(first), True)
    opener = _opener(slurm2.node_devices[first][0])
    try:
        d.wait_log(rf"which job {job} holds \(root, partition scavenger\): requeueing it")
        d.wait_log(rf"slurm: job {job}: requeue done")
        requeued = time.monotonic()
        # Slurm alone starts it again ~121 s after the requeue (EligibleTime); gpu-mon makes it eligible.
        _r, node, started = _run(log, "1", timeout=30)
        assert node == other
        assert started / 1e9 - requeued < 15, "not at once"
        assert slurm2.job(job)["ExcNodeList"] == first
    finally:
        _stop(opener)
    assert len(d.wait_log(r"requeueing it")) == 1
    # Stopped while the job runs elsewhere: Slurm changes a pending job's excluded nodes only; still owed.
    assert d.stop() == 0
    d.wait_log(rf"slurm: job {job}: running elsewhere; it stays off {first} until gpu-mon starts again")
    assert f'"job": {job}' in Path(str(d.state_path) + ".slurm").read_text()


def _kept_off_nodeb(slurm2, daemon_factory, tmp_path, avoid: float, settled: bool = True):
    """A normal job on nodea; a scavenger job on nodeb requeued for someone's use of nodeb's GPU, pending
    and kept off nodeb (`settled`; else as soon as gpu-mon says the requeue is done); that use over.
    (daemon, job, job log, normal job, monotonic time of the requeue)"""
    normal_log, log = tmp_path / "normal.log", tmp_path / "job.log"
    normal = slurm2.submit("normal", 0, normal_log, 1, "--nodelist=nodea")
    _run(normal_log, "0")
    job = slurm2.submit("scavenger", 0, log)
    assert _run(log, "0")[1] == "nodeb"
    d = daemon_factory(_section(avoid_node_seconds=avoid), env=slurm2.env)
    _described(d, job, 1, True)
    opener = _opener(slurm2.node_devices["nodeb"][0])
    try:
        d.wait_log(rf"slurm: job {job}: requeue done")
        requeued = time.monotonic()
        wait_for(
            lambda: (
                not settled
                or (slurm2.job(job)["JobState"], slurm2.job(job)["ExcNodeList"]) == ("PENDING", "nodeb")
            ),
            20,
            "pending, kept off nodeb",
        )
    finally:
        _stop(opener)
    return d, job, log, normal, requeued


def test_gpu_mon_stopping_gives_the_node_back(slurm2, daemon_factory, tmp_path):
    # Stopped at once after the requeue: the job may still be ending, and not yet made eligible.
    d, job, log, _normal, _t = _kept_off_nodeb(slurm2, daemon_factory, tmp_path, 600, settled=False)
    assert d.stop() == 0
    d.wait_log(rf"slurm: job {job} may use this node again")
    assert _run(log, "1")[1] == "nodeb"
    assert not Path(str(d.state_path) + ".slurm").exists()  # nothing owed


def test_the_job_is_kept_off_its_node_while_the_other_is_busy_and_may_return_after(
    slurm2, daemon_factory, tmp_path
):
    _d, job, log, normal, requeued = _kept_off_nodeb(slurm2, daemon_factory, tmp_path, 4)
    _r, node, started = _run(log, "1", timeout=30)  # (nodea is busy: only nodeb, once allowed again)
    assert node == "nodeb"
    assert started / 1e9 >= requeued + 4 - 0.5, "started again within avoid_node_seconds"
    assert slurm2.job(job)["ExcNodeList"] == "(null)"
    assert slurm2.job(normal)["JobState"] == "RUNNING" and slurm2.job(normal)["Restarts"] == "0"


def test_a_normal_job_is_never_touched(slurm2, daemon_factory, tmp_path):
    log = tmp_path / "normal.log"
    job = slurm2.submit("normal", 0, log, 1, "--nodelist=nodea")
    _run(log, "0")
    d = daemon_factory(_section(), env=slurm2.env)
    _described(d, job, 0, False)
    opener = _opener(slurm2.node_devices["nodea"][0])
    try:

        def seen() -> bool:  # a round has seen the opener beside the job (and decided)
            gpu = (d.state().get("gpus") or [{}])[0]
            return any(h.get("pid") == opener.pid for h in gpu.get("holders", []))

        wait_for(seen, 20, "the opener in status")
        d.wait_log(r"slurm: jobs of partitions scavenger yield")
    finally:
        _stop(opener)
    assert "which job" not in d.log() and f"slurm: job {job}" not in d.log()
    assert slurm2.job(job)["JobState"] == "RUNNING" and slurm2.job(job)["Restarts"] == "0"


STUCK = """#!/bin/sh
# scontrol, but the update after the hold (ExcNodeList) says so and never ends: gpu-mon is between its
# hold and its release.
case "$3" in ExcNodeList=*) echo $$ > "{marker}.tmp"; mv "{marker}.tmp" "{marker}"; exec sleep 600;; esac
exec {real} "$@"
"""


def test_a_gpu_mon_killed_between_hold_and_release_releases_the_job_when_it_starts_again(
    slurm2, daemon_factory, tmp_path
):
    import shutil

    marker, stuck = tmp_path / "held", tmp_path / "scontrol-stuck"
    stuck.write_text(STUCK.format(marker=marker, real=shutil.which("scontrol")))
    os.chmod(stuck, 0o755)
    log = tmp_path / "job.log"
    job = slurm2.submit("scavenger", 0, log)
    _r, first, _t = _run(log, "0")
    d = daemon_factory(_section(scontrol=stuck), env=slurm2.env)
    _described(d, job, NODES.index(first), True)
    opener = _opener(slurm2.node_devices[first][0])
    try:
        pid = int(wait_for(lambda: marker.exists() and marker.read_text().strip(), 20, "the hold"))
        owed = Path(str(d.state_path) + ".slurm")
        assert f'"job": {job}' in owed.read_text()  # written before the hold
        assert d.proc is not None
        d.proc.kill()  # between the hold and the release
        d.proc.wait()
        os.kill(pid, signal.SIGKILL)
        assert slurm2.job(job)["Reason"] in ("job_requeued_in_held_state", "JobHeldAdmin")  # held
    finally:
        _stop(opener)
    again = daemon_factory(_section(), env=slurm2.env)
    line = rf"slurm: job {job} was held by a gpu-mon that stopped before it released it: releasing it"
    again.wait_log(line)
    _run(log, "1", timeout=30)  # released, and eligible at once
    assert len(again.wait_log(line)) == 1
    assert again.stop() == 0  # (its exclusion, still owed, is given back)
    assert not Path(str(d.state_path) + ".slurm").exists()


def test_what_a_lift_takes_off_the_excluded_nodes():
    from gpu_mon.slurm.owed import Owed
    from gpu_mon.slurm.preempt import _clear, _without

    added = Owed(1, own="x", node="nodea", released=True)
    assert (_without("x,nodea", added), _clear("x,nodea", added)) == ("x", False)
    assert _clear("x", added)  # the update never happened: nothing to give back
    assert _clear("nodea,x", Owed(1, own="nodea,x", node="nodea"))  # the job's own list named it
    assert (
        _without("gpu[01-02]", Owed(1, "gpu01", "gpu02")),
        _clear("gpu[01-02]", Owed(1, "gpu01", "gpu02")),
    ) == (
        "gpu01",
        False,
    )  # a range: its own list as it was
