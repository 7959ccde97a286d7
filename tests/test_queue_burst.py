"""A burst of submits: the daemon no longer runs a round for each one (the jobs are placed together, at most
every PLACE_GAP), and none is ever left unplaced: with no poll for a minute, every job of the burst has its
reason within seconds, and a job that can start starts. A submit while gpu-mon stops (nothing is placed
then) never makes its loop spin. Real daemon, users made here."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import wait_for
from test_queue import JOB, PY, made_lab, queue_body
from test_queue_door import raw, submit_req

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def lab(sim):
    with made_lab("gmu", ("gmualice", "gmubob"), JOB) as made:
        yield made


def test_a_burst_of_submits_is_placed_and_a_job_after_it_starts_with_no_poll_to_help(lab, daemon_factory):
    # (a poll only every 60 s: what places the burst's jobs is the submits' own wake)
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0, "interval_seconds": 60})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    (held,) = raw(lab, ann, submit_req(ann, hold=True, checked_as_user=True))
    burst = raw(lab, ann, *(submit_req(ann, after=[held["id"]], checked_as_user=True) for _ in range(300)))
    assert all(a["ok"] for a in burst)
    ids = {a["id"] for a in burst}
    after = f"waiting: after job {held['id']}"

    def placed() -> bool:
        jobs = lab.jobs(ann)
        return all(jobs[i]["reason"] == after for i in ids)

    wait_for(placed, 10, "every job of the burst placed", interval=0.2)
    (now,) = raw(lab, ann, submit_req(ann, checked_as_user=True))
    lab.wait_state(ann, now["id"], "done", timeout=10)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_submit_while_gpu_mon_stops_never_makes_its_loop_spin(lab, daemon_factory):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    ready = ann.work / "ready"
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w'); time.sleep(60)"
    )
    lab.submit(ann, "--grace", "20", "--", PY, "-c", stubborn, lab.marker)
    wait_for(ready.exists, 20, "the job ignoring SIGTERM")
    d.signal(signal.SIGTERM)  # (the job keeps gpu-mon stopping for its grace)
    d.wait_log(r"stopping on SIGTERM")
    (held,) = raw(lab, ann, submit_req(ann, hold=True, checked_as_user=True))
    assert held["ok"]
    assert d.proc is not None
    before = _cpu_seconds(d.proc.pid)
    time.sleep(2)  # (a measure over a span, not a wait for a result)
    assert _cpu_seconds(d.proc.pid) - before < 0.6  # (a spinning loop takes a core: about 2 s)
