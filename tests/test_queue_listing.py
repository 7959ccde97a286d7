"""`jobs`' encoded listing reads back exactly as the job's description, and follows every change."""

from __future__ import annotations

import dataclasses
import json

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import Listing
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
    view = View(waiting={7: Waiting("after", after=3)}, index_of={"GPU-a": 0}, placed_up_to=10)
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
