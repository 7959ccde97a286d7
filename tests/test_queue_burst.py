"""A burst of submits: the daemon no longer runs a round for each one (the jobs are placed together, at most
every PLACE_GAP), and none is ever left unplaced: with no poll for a minute, every job of the burst has its
reason within seconds, and a job that can start starts. Real daemon, users made here."""

from __future__ import annotations

import os

import pytest
from conftest import wait_for
from test_queue import JOB, made_lab, queue_body
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
