"""The queue's door and its isolation: every field of a request is checked as it arrives (one line, nothing
queued), names that are not UTF-8 are carried byte for byte, and what one user's job, hook or request does
wrong fails that job alone: another user's running job runs on (restarts 0). Real daemon, users made here
(their own names: other queue tests use gmqalice and gmqbob); raw requests where the CLI
would refuse first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, User, made_lab, queue_body

from gpu_mon.queue.jobs import Job
from gpu_mon.queue.store import Store

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


def test_priority_is_bounded_and_stop_signals_are_those_a_program_catches(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a, held = lab.alice, ("--hold", "--", "/bin/true")
    for p in ("1000001", "-1000001", str(10**30)):
        r = lab.run(a, "submit", "--priority", p, *held)
        assert (r.returncode, r.stderr) == (
            2,
            "gpu-mon: --priority must be a whole number from -1000000 to 1000000\n",
        )
    for sig in ("SEGV", "36", "RTMIN", "KILL", "STOP", "CHLD", "TSTP"):
        r = lab.run(a, "submit", "--stop-signal", sig, *held)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("gpu-mon: --stop-signal ") and "TERM, INT, HUP, QUIT, USR1" in r.stderr
    r = lab.run(a, "submit", "--stop-signal", "NOPE", *held)
    assert (r.returncode, r.stderr) == (2, "gpu-mon: --stop-signal 'NOPE' is not a signal name\n")
    top = lab.submit(a, "--priority", "1000000", "--stop-signal", "USR2", *held)
    low = lab.submit(a, "--priority", "-1000000", "--stop-signal", "B:PWR", *held)
    jobs = lab.jobs(a)
    assert (jobs[top]["priority"], jobs[low]["priority"]) == (1000000, -1000000)


# ------------------------------------------------------------------ what got past an older door

# Traps its stop signal (whatever it is), says so, takes a second (its grace), then exits 0.
GRACEFUL = r"""
import os, signal, sys, time
out = os.path.join(os.getcwd(), "graceful-" + os.environ["GPU_MON_JOB_ID"])
def stop(signum, frame):
    with open(out, "a") as f:
        f.write(f"signal {signum}\n")
    time.sleep(1.0)
    with open(out, "a") as f:
        f.write("end\n")
    sys.exit(0)
signal.signal(int(sys.argv[1]), stop)
with open(out, "a") as f:
    f.write("start\n")
while True:
    time.sleep(0.05)
"""


def older_jobs(lab: Lab, *jobs: Job) -> None:
    """Jobs in the database as an older gpu-mon (whose door let anything in) left them."""
    store = Store.open(str(lab.database), time.time())
    try:
        for job in jobs:
            store.submit(job, 1000)
    finally:
        store.close()


def alices(lab: Lab, **fields: object) -> Job:
    a = lab.alice
    base = dict(id=0, user=a.name, uid=a.uid, gid=a.gid, command=("/bin/true",), cwd=str(a.work))
    base.update(env=(("PATH", "/bin"),), output="", submitted=time.time(), grace=5.0)
    base.update(fields)
    return Job(**base)  # type: ignore[arg-type]


def test_a_hook_or_job_an_older_door_let_in_fails_alone_and_another_users_job_runs_on(lab, daemon_factory):
    nul_env = alices(lab, env=(("X", "a\0b"),), notify=("true",), state="held")
    nul_output = alices(lab, output="/tmp/a\0b", notify=("true",), state="held")
    surrogate = alices(lab, cwd="/tmp/\ud800", notify=("echo \ud800",), state="held")
    older_jobs(lab, nul_env, nul_output, surrogate)
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    bobs = bobs_job_running(lab)
    for job_id in (1, 2, 3):
        r = lab.run(lab.alice, "cancel", str(job_id))
        assert r.returncode == 0, r.stderr
    for job_id in (1, 2, 3):
        lab.wait_state(lab.alice, job_id, "cancelled")
    d.wait_log(r"queue: job 1: cannot run its hook: .*null byte")
    d.wait_log(r"queue: job 2: cannot run its hook: .*null byte")
    d.wait_log(r"queue: job 3: cannot run its hook: .*surrogates not allowed")
    d.poll_passed()
    assert_undisturbed(lab, d, bobs)


@pytest.mark.parametrize("sig", [signal.SIGRTMIN + 2, signal.SIGSEGV])
def test_a_stop_signal_that_would_kill_the_leader_leaves_it_and_the_job_has_its_grace(
    lab, daemon_factory, sig
):
    script = lab.dir / "graceful.py"
    script.write_text(GRACEFUL)
    os.chmod(script, 0o644)
    older_jobs(lab, alices(lab, command=(PY, str(script), str(int(sig))), stop_signal=int(sig)))
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    lab.wait_state(lab.alice, 1, "running")
    out = lab.alice.work / "graceful-1"
    wait_for(lambda: out.exists() and "start" in out.read_text(), 20, "the job's start")
    assert lab.run(lab.alice, "cancel", "1").returncode == 0
    job = lab.wait_state(lab.alice, 1, "cancelled")
    assert out.read_text() == f"start\nsignal {int(sig)}\nend\n"  # its handler ran to its end
    assert (job["exit_status"], job["signal"]) == (0, None), job
    assert "internal error" not in d.log()


def _bytes(path: bytes) -> bytes:
    return Path(os.fsdecode(path)).read_bytes()


def test_names_that_are_not_utf8_are_carried_byte_for_byte(lab, daemon_factory):
    """A directory, an argument, an environment value and an output file named with bytes that are not
    UTF-8 (as Linux allows): the job and its hook get the very bytes."""
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.alice
    where = os.path.join(os.fsencode(a.work), b"d\xff\xc3")
    os.mkdir(where)
    os.chown(where, a.uid, a.gid)
    output = os.path.join(where, b"out\xfe.log")
    show = 'printf "%s|%s|%s\\n" "$X" "$(pwd)" "$1"'
    r = lab.run(
        a,
        "submit",
        "--output",
        os.fsdecode(output),
        "--notify",
        f"{show.replace('$1', 'hook')} > hook-out",
        "--",
        "/bin/sh",
        "-c",
        f"{show} > job-out",
        "sh",
        os.fsdecode(b"arg\x80"),
        cwd=Path(os.fsdecode(where)),
        env={"X": os.fsdecode(b"v\xfe\x80")},
    )
    assert r.returncode == 0, r.stderr
    lab.wait_state(a, 1, "done")
    assert _bytes(os.path.join(where, b"job-out")) == b"v\xfe\x80|" + where + b"|arg\x80\n"
    assert os.path.exists(output) and os.stat(output).st_uid == a.uid
    hook_out = os.path.join(where, b"hook-out")
    wait_for(lambda: os.path.exists(hook_out) and _bytes(hook_out).endswith(b"\n"), 20, "the hook")
    assert _bytes(hook_out) == b"v\xfe\x80|" + where + b"|hook\n"
    listed = lab.jobs(a)[1]
    assert listed["command"][-1] == os.fsdecode(b"arg\x80")  # (JSON: \udc80, the byte as Python spells it)
    assert "internal error" not in d.log()
