"""Mistakes refused at submit, as the user: a command not found or not executable on the job's PATH, an
--output whose directory is missing or not the user's to write (a pattern's directory too), a home that
does not exist for the default output. One line, exit 2, nothing queued; checked by the daemon with the
user's own rights (a raw request that skips the client learns nothing root could see). A job that still
cannot start (its directory removed after the submit) says the true cause. Real daemon, users made here."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import wait_for
from test_queue import JOB, Lab, User, made_lab, queue_body
from test_queue_door import raw

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def lab(sim):
    """Two users of this file's own (other queue tests use theirs)."""
    with made_lab("gmk", ("gmkann", "gmkben"), JOB) as made:
        yield made


def _refused(lab: Lab, user: User, *args: str, cwd=None) -> str:
    r = lab.run(user, "submit", *args, cwd=cwd)
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr)
    return r.stderr


def _raw(lab: Lab, user: User, req: dict) -> dict:
    return raw(lab, user, req)[0]


def test_what_cannot_start_is_refused_at_submit_as_the_user_and_nothing_is_queued(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    err = _refused(lab, ann, "--", "no-such-command")
    assert err == "gpu-mon: no-such-command: command not found on the job's PATH (/usr/bin:/bin)\n"
    script = ann.work / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    os.chown(script, ann.uid, ann.gid)
    assert _refused(lab, ann, "--", "./run.sh") == "gpu-mon: ./run.sh: Permission denied (not executable)\n"
    assert _refused(lab, ann, "--", "sub/x") == "gpu-mon: sub/x: No such file or directory\n"
    assert _refused(lab, ann, "--output", "/root/out.log", "--", "true") == (
        "gpu-mon: cannot open /root/out.log: Permission denied\n"
    )
    # (a path the user may not look into reads as one that is not there: root's view never leaks)
    gone = "gpu-mon: cannot open /root/x/out.log: No such file or directory (make /root/x first)\n"
    assert _refused(lab, ann, "--output", "/root/x/out.log", "--", "true") == gone
    pattern = f"{ann.home}/sweep/logs/%A_%a.log"
    assert _refused(lab, ann, "--array", "0-1", "--output", pattern, "--", "true") == (
        f"gpu-mon: cannot open {pattern}: No such file or directory (make {ann.home}/sweep/logs first)\n"
    )
    # a raw request that skips the client meets the same check, made with the user's rights, not root's
    req = {"op": "submit", "command": ["/bin/true"], "cwd": str(ann.work), "env": {"PATH": "/bin"}}
    answer = _raw(lab, ann, {**req, "output": "/root/out.log"})
    assert answer == {"ok": False, "error": "cannot open /root/out.log: Permission denied", "code": 2}
    answer = _raw(lab, ann, {**req, "cwd": "/root"})
    assert answer["error"] == "cannot enter the submit directory /root: Permission denied"
    assert lab.jobs(ann) == {}  # nothing was queued
    # made right, the same submits run
    subprocess.run(["mkdir", "-p", str(ann.home / "sweep/logs")], check=True, user=ann.uid, group=ann.gid)
    arr = lab.submit(
        ann, "--array", "0-1", "--output", pattern, "--", "sh", "-c", "echo el $GPU_MON_ARRAY_INDEX"
    )
    os.chmod(script, 0o755)
    one = lab.submit(ann, "--", "./run.sh")
    lab.wait_state(ann, one, "done")
    wait_for(lambda: {j["state"] for j in lab.jobs(ann).values()} == {"done"}, 30, "the array's end")
    assert (ann.home / f"sweep/logs/{arr}_1.log").read_text() == "el 1\n"
    # `gpu-mon submit` checked it as the user and says so: the daemon answers at once, without checking
    # again (a client that says so falsely harms only its own job, which fails later with the true cause)
    said = _raw(lab, ann, {**req, "output": "/root/out.log", "hold": True, "checked_as_user": True})
    assert said["ok"] is True and lab.jobs(ann)[said["id"]]["state"] == "held"


def test_a_user_whose_home_does_not_exist_is_told_at_submit(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ben = lab.bob
    missing = f"{ben.home}-gone"
    subprocess.run(["usermod", "-d", missing, ben.name], check=True, capture_output=True)
    try:
        err = _refused(lab, ben, "--", "true")
        assert err == f"gpu-mon: your home directory {missing} does not exist: give --output FILE\n"
        assert lab.jobs(ben) == {}
        out = ben.work / "out.log"
        lab.wait_state(ben, lab.submit(ben, "--output", str(out), "--", "echo", "fine"), "done")
        assert out.read_text() == "fine\n"
    finally:
        subprocess.run(["usermod", "-d", str(ben.home), ben.name], check=True, capture_output=True)


def test_a_job_whose_output_directory_went_away_says_the_true_cause(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    logs = ann.work / "logs"
    subprocess.run(["mkdir", str(logs)], check=True, user=ann.uid, group=ann.gid)
    hook = "echo $GPU_MON_JOB_STATE: $GPU_MON_JOB_REASON >> hook.log"
    job = lab.submit(ann, "--hold", "--notify", hook, "--output", f"{logs}/%j.log", "--", "true")
    shutil.rmtree(logs)
    assert lab.run(ann, "release", str(job)).returncode == 0
    failed = lab.wait_state(ann, job, "failed")
    cause = f"cannot open {logs}/{job}.log: No such file or directory"
    assert failed["reason"] == cause, failed
    hook_said = lambda: (ann.work / "hook.log").exists() and (ann.work / "hook.log").read_text()  # noqa: E731
    assert wait_for(hook_said, 20, "the hook") == f"failed: {cause}\n"
    r = lab.run(ann, "logs", str(job))
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {job} has no output: {cause}\n")
