"""`jobs`' encoded listing reads back exactly as the job's description, and follows every change."""

from __future__ import annotations

import dataclasses
import json

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import Listing, elapsed
from gpu_mon.queue.placement import Waiting
from gpu_mon.queue.requests import View, _described, describe


def job(**kw: object) -> Job:
    base = dict(
        id=7,
        user="alice",
        uid=1000,
        gid=1000,
        command=("python3", 'say "hi"\\', "ünï\u2028", "\x00x"),
        cwd="/",
        env=(),
        output="",
        submitted=1.7e9 + 0.9,
        name='lr "1e-3" \n',
    )
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def test_each_job_reads_back_as_its_description_and_changes_are_seen():
    listing = Listing()
    view = View(waiting={7: Waiting("after", after="3")}, index_of={"GPU-a": 0}, placed_up_to=10)
    queued = job(priority=-5)
    running = J.started(job(id=8), ("GPU-a", "GPU-b"), 1.7e9 + 60, 1, 1)
    ended = dataclasses.replace(J.ended(running, 1.7e9 + 120, 3), id=9)
    for j in (queued, running, ended, J.held(job(id=11)), job(id=12)):
        want = describe(j, view, 1.7e9 + 200)
        reason = want["reason"]
        got = json.loads(listing.encoded(j, reason, tuple(want["gpu_indices"])))
        assert got == want and list(got) == list(want)  # the same keys in the same order
        assert listing.encoded(j, reason, tuple(want["gpu_indices"])) is listing.encoded(
            j, reason, tuple(want["gpu_indices"])
        )  # kept
    assert (
        json.loads(listing.encoded(queued, "waiting: 2 jobs ahead", ()))["reason"] == "waiting: 2 jobs ahead"
    )
    moved = J.held(queued)  # a new object: encoded afresh
    assert json.loads(listing.encoded(moved, "held", ())) == _described(moved, "held", ())
    listing.keep_only([8])
    assert len(listing) == 1
    fresh = J.released(moved)
    listing.prepare(fresh)  # its fixed pieces made ahead: the first listing adds the reason
    assert json.loads(listing.encoded(fresh, "waiting: x", ())) == _described(fresh, "waiting: x", ())


def test_a_run_starts_without_the_last_runs_exit_and_an_ended_job_says_how_long_it_ran():
    first = J.started(job(), ("GPU-a",), 1.7e9, 1, 1)
    back = J.ended(J.stopping(first, J.STOP_PREEMPT), 1.7e9 + 60, 143)
    assert (back.state, back.exit_status) == (J.QUEUED, 143)
    again = J.started(back, ("GPU-a",), 1.7e9 + 100, 2, 2)
    view = View()
    assert describe(again, view, 1.7e9 + 101)["exit_status"] is None  # (not the last run's 143)
    assert describe(again, view, 1.7e9 + 101)["run_seconds"] is None
    killed = J.ended(again, 1.7e9 + 190, 143, 15)
    assert (describe(killed, view, 0)["exit_status"], describe(killed, view, 0)["signal"]) == (143, 15)
    assert describe(killed, view, 0)["run_seconds"] == 90
    assert describe(J.ended(again, 1.7e9 + 190, 143), view, 0)["signal"] is None  # it exited 143
    # cancelled while waiting after a run: that run lasted until it went back to the queue
    cancelled = J.cancelled(back, 1.7e9 + 500, "cancelled by root")
    assert describe(cancelled, view, 0)["run_seconds"] == 60
    assert elapsed(describe(cancelled, view, 0), 1.7e9 + 900) == 60
    assert elapsed(describe(job(), view, 0), 1.7e9) is None  # never ran
    live = describe(again, view, 0)
    assert elapsed(live, 1.7e9 + 130) == 30
