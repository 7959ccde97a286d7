"""`jobs`' encoded listing reads back exactly as the job's description, and follows every change; what it
holds of each job is small whatever the job (an array's command once, a long command cut)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from gpu_mon.config import QueueSection
from gpu_mon.queue import jobs as J
from gpu_mon.queue.described import View, _described, describe, estimate, shared_of
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import (
    LIST_COMMAND,
    LIST_REASON,
    Listing,
    command_json,
    elapsed,
    iso,
    listed_reason,
)
from gpu_mon.queue.placement import Waiting
from gpu_mon.queue.protocol import _join
from gpu_mon.queue.requests import Peer, Requests
from gpu_mon.queue.store import Store


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


def test_a_queued_jobs_estimated_start_is_in_its_description_and_listing_and_follows_the_placement():
    listing, queued, held = Listing(), job(), J.held(job(id=11))
    running = J.started(job(id=8), ("GPU-a",), 1.7e9 + 60, 1, 1)
    view = View(waiting={7: Waiting("ahead", count=1)}, placed_up_to=20, estimates={7: 1.7e9 + 90, 8: 1.0})
    for j, want in ((queued, iso(1.7e9 + 90)), (running, None), (held, None)):
        described = describe(j, view, 1.7e9)
        assert described["estimated_start"] == want  # (only a queued job has one)
        got = json.loads(listing.encoded(j, described["reason"], (), start=estimate(j, view)))
        assert got == described | {"gpu_indices": []}
    later = View(waiting=view.waiting, placed_up_to=20, estimates={7: 1.7e9 + 150})
    got = json.loads(listing.encoded(queued, describe(queued, later, 1.7e9)["reason"], (), start=1.7e9 + 150))
    assert got["estimated_start"] == iso(1.7e9 + 150)  # (kept pieces, the new estimate)
    assert describe(queued, View(), 1.7e9)["estimated_start"] is None  # unknown


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
    assert elapsed(live, 1.7e9 + 130) == 30 + 60  # TIME: this run so far and the first one
    assert live["ran_seconds"] == 60 and describe(job(), view, 0)["ran_seconds"] is None
    assert describe(killed, view, 0)["ran_seconds"] == 60 + 90  # every run, where run_seconds is the last's
    assert json.loads(Listing().encoded(killed, "", ()))["ran_seconds"] == 150
    assert elapsed(describe(killed, view, 0), 0) == 150
    older = dataclasses.replace(killed, ran_seconds=0.0, gpu_seconds=300.0, gpus_wanted=2)
    assert describe(older, view, 0)["ran_seconds"] == 150  # an older gpu-mon's row: GPU-seconds / GPUs


def test_an_element_lists_no_command_its_arrays_is_given_once_and_a_long_command_is_cut_but_when_named():
    """(Issue 46, item 4: every element listed its array's 60 KB argument.) An element's JSON carries what
    differs; its array's command is `shared` once; a command over LIST_COMMAND bytes of JSON is cut (its
    first arguments, the last cut short, `command_cut`), whole when the listing names the job."""
    listing, view = Listing(), View()
    long = ("python3", "-c", "\x01" * 65000, "tail")
    element = job(id=22, array_id=22, array_index=0, command=long)
    got = json.loads(listing.encoded(element, "held", ()))
    assert "command" not in got and "command_cut" not in got
    assert got == describe(element, view, 0) | {"reason": "held"}
    assert (got["array_id"], got["array_index"]) == (22, 0)
    assert len(listing.encoded(element, "held", ())) < 600
    shared = json.loads(listing.shared(element))
    assert shared == shared_of(element) and shared["command_cut"] is True
    assert shared["command"][:2] == ["python3", "-c"] and len(shared["command"]) == 3
    assert len(listing.shared(element)) <= LIST_COMMAND + 40
    assert json.loads(listing.shared(element, whole=True)) == {"command": list(long), "command_cut": False}
    single = job(id=30, command=long)
    cut = json.loads(listing.encoded(single, "held", ()))
    assert cut == _described(single, "held", ()) and cut["command_cut"] is True
    assert cut["command"][2] == "\x01" * cut["command"][2].count("\x01") and len(cut["command"]) == 3
    whole = json.loads(listing.encoded(single, "held", (), whole=True))
    assert whole == _described(single, "held", (), whole=True) and whole["command"] == list(long)
    assert json.loads(listing.encoded(single, "held", ()))["command_cut"] is True  # (the whole one not kept)


@pytest.mark.parametrize(
    "command",
    [
        ("a" * 5000,),
        ("x",) * 2000,  # (many short ones: the cut falls between two)
        ("é" * 700, "\U0001f600" * 400, "b"),  # (6 and 12 bytes a character)
        ("a" * 4092, "b"),
        (os.fsdecode(b"\xff") * 2000,),  # (a byte that is not UTF-8: \udcff)
    ],
)
def test_a_cut_command_is_the_longest_start_that_fits(command):
    text, cut = command_json(command)
    assert cut and len(text) <= LIST_COMMAND
    got = json.loads(text)
    last = len(got) - 1
    assert got[:last] == list(command[:last]) and command[last].startswith(got[last])
    longer = [*got[:last], command[last][: len(got[last]) + 1]]  # one character more: too long
    assert got[last] == command[last] or len(json.dumps(longer)) - last > LIST_COMMAND
    assert command_json(("python3", "train.py")) == ('["python3","train.py"]', False)


def test_a_listing_of_five_cancelled_arrays_of_a_long_argument_is_small_and_gives_each_array_once(tmp_path):
    """The issue's case in-process: five 1000-element arrays of a 60 KB argument, cancelled; the daemon's
    `jobs --all` pages (71478dc: 5000 pages, 1.8 GB with this argument; 4-9 s) join to every element, each
    with its id and state, and the five arrays' shared values once."""
    store = Store.open(str(tmp_path / "q.sqlite"), time.time())
    base = job(id=0, uid=0, user="root", name="", command=("true", "\x01" * 60000))
    for _ in range(5):
        first, _ahead = store.submit_array(base, range(1000), 100000)
        store.change_many(
            (j.id, lambda j: J.cancelled(j, time.time(), "cancelled by root"))
            for j in store.elements(first.id)
        )
    requests = Requests(store, QueueSection(), View, lambda: None)
    pages = list(requests.answer(Peer(1, 0, 0), {"op": "jobs", "all": True}).bodies)
    assert sum(map(len, pages)) < 3_000_000
    answer = json.loads(pages[0])
    for page in pages[1:]:
        assert answer.pop("continued") is True
        _join(answer, json.loads(page))
    assert [(j["state"], j["array_index"]) for j in answer["jobs"]] == [
        ("cancelled", i % 1000) for i in range(5000)
    ]
    assert sorted(map(int, answer["arrays"])) == sorted({j["array_id"] for j in answer["jobs"]})
    assert all(a["command"][0] == "true" and a["command_cut"] for a in answer["arrays"].values())
    named = requests.answer(Peer(1, 0, 0), {"op": "jobs", "ids": ["1_5"]})
    (page,) = list(named.bodies)
    one = json.loads(page)
    assert [j["id"] for j in one["jobs"]] == [6] and one["arrays"] == {
        "1": {"command": ["true", "\x01" * 60000], "command_cut": False}
    }
    store.close()


def test_a_long_reason_is_cut_in_a_listing_and_whole_when_named():
    """A reason that names a long path (an element that could not open its output: up to 4096 bytes, each
    escaped to six) ends in "..." at LIST_REASON characters; a listing that names the job gives it whole."""
    listing, view = Listing(), View()
    path = "/x/" + "\x01" * 4000
    failed = dataclasses.replace(
        J.ended(J.started(job(id=40, array_id=40), ("GPU-a",), 1.7e9, 1, 1), 1.7e9 + 1, 1),
        reason=f"cannot open {path}: No such file or directory",
        preempted_reason=f"GPU 0 busy: {path}",
    )
    got = describe(failed, view, 0)
    assert len(got["reason"]) == LIST_REASON and got["reason"].startswith("cannot open /x/\x01")
    assert got["reason"].endswith("...") and got["preempted_reason"].endswith("...")
    assert json.loads(listing.encoded(failed, got["reason"], ())) == got
    assert len(listing.encoded(failed, got["reason"], ())) < 2 * 6 * LIST_REASON + 600
    named = describe(failed, view, 0, whole=True)
    assert named["reason"] == failed.reason and named["preempted_reason"] == failed.preempted_reason
    assert json.loads(listing.encoded(failed, named["reason"], (), whole=True)) == named
    assert listed_reason("waiting: 3 jobs ahead") == "waiting: 3 jobs ahead"
