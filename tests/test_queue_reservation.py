"""The head of the fair order's reservation (Slurm's backfill) and estimated starts, on the real daemon
with simulated GPUs and users made here (their own names: other queue tests use theirs). The pure
placement's cases are in tests/test_queue_placement.py."""

from __future__ import annotations

import datetime
import os
import time

import pytest
from conftest import wait_for
from test_queue import made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

JOB = "import sys, time\ntime.sleep(float(sys.argv[1]))\n"


@pytest.fixture
def rlab(sim):
    """Two users (gmvann streams one-GPU jobs, gmvcal wants both GPUs), removed afterwards."""
    with made_lab("gmv", ("gmvann", "gmvcal"), JOB) as lab:
        yield lab


def _t(iso: str) -> float:
    return datetime.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S%z").timestamp()


def test_a_two_gpu_job_first_in_fair_order_starts_within_one_of_a_stream_of_one_gpu_jobs(
    rlab, daemon_factory
):
    # The case, shortened: ann streams one-GPU jobs from two arrays (%1 each, staggered), so a GPU
    # frees every half second or so; without a reservation each went to her next job and cal's waited for
    # both arrays to end (40 s and more).
    lab = rlab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    lab.submit(lab.alice, "--array", "0-39%1", "--", "sleep", "1")
    time.sleep(0.5)
    lab.submit(lab.alice, "--array", "0-39%1", "--", "sleep", "1.4")
    wait_for(lambda: sum(j["state"] == "done" for j in lab.jobs(lab.alice).values()) >= 2, 30, "ann's jobs")
    cal = lab.submit(lab.bob, "--gpus", "2", "--", "sleep", "1")
    job = lab.wait_state(lab.bob, cal, "done", timeout=30)
    waited = _t(job["started"]) - _t(job["submitted"])
    # within one of ann's jobs (1.4 s), give or take the whole seconds of the times and a loaded machine
    assert waited <= 4, f"cal's 2-GPU job waited {waited} s"
    left = [j for j in lab.jobs(lab.alice).values() if j["state"] not in ("done", "running")]
    assert len(left) > 20  # (ann's stream went on long after: cal's job did not wait for its end)
    for j in left:
        lab.run(lab.alice, "cancel", str(j["array_id"]))


def test_a_kept_gpu_says_for_whom_a_short_job_backfills_it_and_estimates_follow_time_limits(
    rlab, daemon_factory
):
    lab = rlab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    long = lab.submit(lab.alice, "--time-limit", "60", "--", "sleep", "60")
    lab.wait_state(lab.alice, long, "running")
    cal = lab.submit(lab.bob, "--gpus", "2", "--time-limit", "10", "--", "sleep", "0.5")
    after = lab.submit(lab.alice, "--", "sleep", "30")  # no time limit: never before cal's start
    reason = lambda: lab.jobs(lab.alice)[after]["reason"]  # noqa: E731
    wait_for(lambda: reason() == f"waiting: GPU 1 kept for job {cal}", 20, "the kept reason")
    jobs = lab.jobs(lab.bob)
    started = _t(jobs[long]["started"])
    # cal's job starts when ann's first ends (its time limit); ann's next one after cal's 10 s
    assert _t(jobs[cal]["estimated_start"]) == int(started) + 60
    assert _t(jobs[after]["estimated_start"]) == int(started) + 70
    assert jobs[long]["estimated_start"] is None  # (running: none)
    table = lab.run(lab.bob, "jobs", "--all").stdout
    clock = time.strftime("%H:%M:%S", time.localtime(int(started) + 60))
    assert f"(estimated start {clock})" in table
    assert f"GPU 1 kept for job {cal}" in table
    # a job whose time limit ends before cal's start may use the kept GPU meanwhile (a backfill)
    short = lab.submit(lab.alice, "--time-limit", "20", "--", "sleep", "0.3")
    lab.wait_state(lab.alice, short, "done")
    assert lab.jobs(lab.alice)[after]["state"] == "queued"
    # ann's first job ends: cal's starts on both GPUs, before ann's next
    lab.run(lab.alice, "cancel", str(long))
    job = lab.wait_state(lab.bob, cal, "done", timeout=30)
    assert job["estimated_start"] is None
    lab.run(lab.alice, "cancel", str(after))
