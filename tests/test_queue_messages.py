"""What the queue says: a start delay that counts down, a job that could never start refused at submit, an
exit status told from a signal, a running job without its last run's exit, and the words of the help,
the shutdown line and a cancel (issue 29)."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from conftest import GPU_MON, ROOT, foreign_opener_cmd, wait_for
from test_queue import PY, lab, queue_body  # noqa: F401 - (lab: the fixture)

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.requests import cancelled_reason

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


def _seconds_left(reason: str) -> int:
    m = re.fullmatch(r"waiting: GPU free, starting in (\d+) s", reason)
    return int(m.group(1)) if m else -1


@root_only
def test_the_start_delay_counts_down(lab, daemon_factory):  # noqa: F811
    daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 60})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, *lab.job_cmd("exit", "0"))
    left = lambda: _seconds_left(lab.jobs(lab.alice)[job_id]["reason"])  # noqa: E731
    first = wait_for(lambda: (s := left()) >= 0 and s + 1, 20, "the start delay as the reason") - 1
    assert first > 0  # (it was `starting in 0 s` for the whole delay)
    later = wait_for(lambda: 0 < (s := left()) < first and s, 20, "fewer seconds left")
    assert 0 < later < first <= 60


@root_only
def test_a_job_that_could_never_start_is_refused_at_submit_and_one_a_reload_left_so_waits(
    lab,  # noqa: F811
    daemon_factory,
):
    body = queue_body(lab, "max_gpus_per_user = 3\n")
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    lab.wait_state(lab.alice, lab.submit(lab.alice, *lab.job_cmd("exit", "0")), "done")  # (placed once)
    r = lab.run(lab.alice, "submit", "--gpus", "3", *lab.job_cmd("exit", "0"))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == "gpu-mon: --gpus 3: the queue has 2 GPUs; the job could never start\n"
    held = lab.submit(lab.alice, "--hold", "--gpus", "2", *lab.job_cmd("exit", "0"))
    assert set(lab.jobs(lab.alice)) == {1, held}  # nothing queued for the refused one
    d.write_config(queue_body(lab, "max_gpus_per_user = 1\n"), {"start_delay_seconds": 0})
    d.signal(signal.SIGHUP)
    d.wait_log("reloaded")
    refused = "gpu-mon: --gpus 2 is over the limit of 1 per user\n"
    wait_for(lambda: lab.run(lab.alice, "submit", "--gpus", "2", *lab.job_cmd("exit", "0")).stderr == refused)
    assert lab.run(lab.alice, "release", str(held)).returncode == 0  # queued before: it waits, and says why
    wait_for(
        lambda: lab.jobs(lab.alice)[held]["reason"] == "waiting: wants 2 GPUs, over the limit of 1 per user",
        20,
        "the reason of a job a reload left over the limit",
    )


@root_only
def test_an_exit_status_of_143_is_not_a_signal_and_a_rerun_shows_no_exit_until_it_ends(
    lab,  # noqa: F811
    daemon_factory,
    sim,
):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    exits = lab.submit(lab.alice, "--", "/bin/sh", "-c", f"exit 143 # {lab.marker}")
    killed = lab.submit(lab.alice, "--", "/bin/sh", "-c", f"kill -TERM $$ # {lab.marker}")
    assert (
        lab.wait_state(lab.alice, exits, "failed")["exit_status"],
        lab.jobs(lab.alice)[exits]["signal"],
    ) == (
        143,
        None,
    )
    job = lab.wait_state(lab.alice, killed, "failed")
    assert (job["exit_status"], job["signal"]) == (143, 15)
    d.wait_log(rf"queue: job {exits} of gmqalice exited with status 143: failed")
    d.wait_log(rf"queue: job {killed} of gmqalice was killed by signal 15: failed")
    table = lab.run(lab.alice, "jobs", "--all").stdout.splitlines()
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows[str(exits)].endswith("exited with status 143")
    assert rows[str(killed)].endswith("was killed by signal 15")
    assert all(rows[str(i)].split()[4] != "-" for i in (exits, killed))  # how long they ran (TIME)

    # a job that traps SIGTERM (exit 143) is preempted, then runs again: no exit status while it runs
    job_id = lab.submit(lab.alice, *lab.job_cmd("forever"))
    lab.wait_state(lab.alice, job_id, "running")
    wait_for(lambda: lab.reports(lab.alice, job_id), 20, "the job's first report")
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE, text=True)
    try:
        assert opener.stdout is not None and opener.stdout.readline() == "open\n"
        assert lab.wait_state(lab.alice, job_id, "queued")["exit_status"] == 143
        d.wait_log(rf"queue: job {job_id} of gmqalice exited with status 143: back in the queue")
    finally:
        opener.kill()
        opener.wait()
    again = wait_for(
        lambda: (j := lab.jobs(lab.alice)[job_id])["state"] == J.RUNNING and j["restarts"] == 1 and j,
        30,
        "the job running again",
    )
    assert (again["exit_status"], again["signal"]) == (None, None)
    assert d.stop() == 0
    assert re.search(r"stopping on SIGTERM: 1 queue job\(s\) to stop, back to the queue$", d.log(), re.M)
    assert "workload(s)" not in d.log()


def test_a_cancel_of_a_job_back_in_the_queue_says_how_its_last_run_ended():
    job = Job(1, "alice", 1000, 1000, ("x",), "/", (), "", 1.7e9)
    assert cancelled_reason(job, "root") == "cancelled by root"
    ran = J.ended(J.stopping(J.started(job, ("GPU-a",), 1.7e9, 1, 1), J.STOP_PREEMPT), 1.7e9 + 9, 143)
    assert cancelled_reason(ran, "root") == "cancelled by root while queued (last run preempted)"
    assert cancelled_reason(J.held(ran), "bob") == "cancelled by bob while held (last run preempted)"


def test_the_help_says_release_your_held_jobs():
    r = subprocess.run([*GPU_MON, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "release your held jobs" in r.stdout and "held your" not in r.stdout
    assert PY  # (the lab's interpreter: the other tests run jobs with it)
