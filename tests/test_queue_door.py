"""The queue's door and its isolation: every field of a request is checked as it arrives (one line, nothing
queued), names that are not UTF-8 are carried byte for byte, and what one user's job, hook or request does
wrong fails that job alone: another user's running job runs on (restarts 0). Real daemon, users made here
(their own names: other queue tests use gmqalice and gmqbob); raw requests where the CLI
would refuse first."""

from __future__ import annotations

import json
import os
import subprocess
from typing import List

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, User, made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

# Requests as the user, straight to the socket (the project's own protocol module): one JSON list on stdin
# (lone surrogates as JSON escapes), one answer a line.
RAW = """
import json, sys
from gpu_mon.queue.protocol import NoDaemon, request
for req in json.loads(sys.stdin.read()):
    try:
        print(json.dumps(request(sys.argv[1], req)), flush=True)
    except NoDaemon as err:
        print(json.dumps({"no_answer": str(err)}), flush=True)
"""


@pytest.fixture
def lab(sim):
    with made_lab("gmd", ("gmdalice", "gmdbob"), JOB) as made:
        yield made


def raw(lab: Lab, user: User, *reqs: dict) -> List[dict]:
    """Each request's answer, sent as `user`."""
    r = subprocess.run(
        [PY, "-c", RAW, str(lab.socket)],
        input=json.dumps(list(reqs)),
        capture_output=True,
        text=True,
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        cwd=str(user.work),
        env={"PATH": "/usr/bin:/bin", "HOME": str(user.home), "PYTHONPATH": str(lab.code), "LANG": "C.UTF-8"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def submit_req(user: User, **fields: object) -> dict:
    req: dict = {"op": "submit", "command": ["/bin/true"], "cwd": str(user.work), "env": {"PATH": "/bin"}}
    req.update(fields)
    return req


def bobs_job_running(lab: Lab) -> int:
    job_id = lab.submit(lab.bob, *lab.job_cmd("forever"))
    lab.wait_running(lab.bob, job_id)
    return job_id


def assert_undisturbed(lab: Lab, d, job_id: int) -> None:
    job = lab.jobs(lab.bob)[job_id]
    assert (job["state"], job["restarts"]) == ("running", 0), job
    assert "internal error" not in d.log()
    assert [e["event"] for e in lab.reports(lab.bob, job_id)] == ["start"]


# ------------------------------------------------------------------ the door


def test_hostile_requests_are_refused_in_one_line_and_another_users_job_runs_on(lab, daemon_factory):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    bobs = bobs_job_running(lab)
    a = lab.alice
    hostile = [
        (submit_req(a, env={"X": "a\0b"}, hold=True, array="0-3", notify="true"), "env"),
        (submit_req(a, env={"A=B": "x"}), "env"),
        (submit_req(a, env={"": "x"}), "env"),
        (submit_req(a, env={"X\0": "x"}), "env"),
        (submit_req(a, env={"X": 5}), "env"),
        (submit_req(a, env=["X"]), "env"),
        (submit_req(a, env={"X": "\ud800"}), "env"),
        (submit_req(a, notify="echo \ud800"), "--notify"),
        (submit_req(a, notify="a\0b"), "--notify"),
        (submit_req(a, notify=7), "--notify"),
        (submit_req(a, cwd="/tmp/\ud800"), "directory"),
        (submit_req(a, cwd="/tmp/a\0b"), "directory"),
        (submit_req(a, cwd="/" + "a" * 5000), "directory"),
        (submit_req(a, output="/tmp/\udfff"), "--output"),
        (submit_req(a, command=["/bin/true", "\ud800"]), "command"),
        (submit_req(a, command=["/bin/true", 1]), "command"),
        (submit_req(a, name="\ud800"), "name"),
        (submit_req(a, name="a\0"), "name"),
        (submit_req(a, gpus=10**30), "--gpus"),
        (submit_req(a, gpus=True), "--gpus"),
        (submit_req(a, priority=10**30), "--priority"),
        (submit_req(a, priority=1.5), "--priority"),
        (submit_req(a, stop_signal=36), "--stop-signal"),
        (submit_req(a, stop_signal="SEGV"), "--stop-signal"),
        (submit_req(a, stop_signal="KILL"), "--stop-signal"),
        (submit_req(a, grace=float("inf")), "--grace"),
        (submit_req(a, time_limit=-1), "--time-limit"),
        (submit_req(a, array=5), "--array"),
        (submit_req(a, after=[True]), "--after"),
        (submit_req(a, hold="yes"), "hold"),
        (submit_req(a, notify_each=[1]), "notify_each"),
        ({"op": "cancel", "ids": ["\ud800"]}, None),
        ({"op": "logs-path", "id": {"x": 1}}, "job id"),
        ({"op": "jobs", "user": 5}, "--user"),
        ({"op": "cancel", "select": {"name": "a\0b"}}, "--name"),
    ]
    answers = raw(lab, a, *(req for req, _ in hostile))
    for (req, word), answer in zip(hostile, answers):
        if word is None:  # (one result per id)
            (answer,) = answer["results"]
            word = "job id"
        assert answer["ok"] is False and answer["code"] in (1, 2), (req, answer)
        assert "\n" not in answer["error"] and word in answer["error"], (req, answer)
    assert raw(lab, a, {"op": "jobs", "user": "gmdalice", "all": True})[0]["jobs"] == []  # nothing queued
    # The reported way in: a held array with a NUL in its environment and a hook, cancelled, 20 times.
    for _ in range(3):
        (answer,) = raw(lab, a, submit_req(a, env={"X": "a\0b"}, hold=True, array="0-3", notify="true"))
        assert answer["ok"] is False
        raw(lab, a, {"op": "cancel", "select": {"all": True}})
    d.poll_passed()
    assert_undisturbed(lab, d, bobs)
