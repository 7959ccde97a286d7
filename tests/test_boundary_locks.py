"""Issue 36 item 4: no user can keep the daemon, or its queue, from starting by holding a lock file.

The locks are 0600 (no user may open them); one an earlier gpu-mon made 0644, which a user holds open and
flocked, is replaced; a queue that could not start is tried again and `gpu-mon status` says so."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from conftest import wait_for
from test_queue import PY, Lab, User, made_lab, queue_body

from gpu_mon.engine import lock

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes users")

HOLD = """
import fcntl, sys, time
fds = [open(path) for path in sys.argv[1:]]  # read-only: all a 0644 file lets a user have
for f in fds:
    fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmlk", ("gmlkalice", "gmlkbob"), "import sys; sys.exit(0)\n") as made:
        yield made


@contextlib.contextmanager
def held_by(user: User, *paths: Path) -> Iterator[subprocess.Popen]:
    """A process of `user` that opened each file read-only and holds an exclusive flock on it."""
    p = subprocess.Popen(
        [PY, "-c", HOLD, *map(str, paths)],
        stdout=subprocess.PIPE,
        text=True,
        user=user.uid,
        group=user.gid,
        extra_groups=[],
    )
    try:
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        yield p
    finally:
        p.kill()
        p.wait()


def status(lab: Lab, user: User, conf: Path) -> dict:
    r = lab.run(user, "--config", str(conf), "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def client_conf(lab: Lab, state: Path) -> Path:
    conf = lab.dir / "status.conf"
    conf.write_text(f"[defaults]\nstate_file = {state}\n[queue]\nsocket = {lab.socket}\n")
    os.chmod(conf, 0o644)
    return conf


def cannot_open(user: User, path: Path) -> bool:
    r = subprocess.run(
        [PY, "-c", "import sys; open(sys.argv[1])", str(path)],
        capture_output=True,
        text=True,
        user=user.uid,
        group=user.gid,
        extra_groups=[],
    )
    return r.returncode != 0 and "PermissionError" in r.stderr


def test_a_users_flock_on_an_old_0644_lock_keeps_neither_the_daemon_nor_its_queue_out(lab, daemon_factory):
    run_dir = lab.dir / "run"
    run_dir.mkdir(mode=0o755)
    state = run_dir / "state.json"
    old_locks = (Path(lock.lock_path(str(state))), Path(lock.lock_path(str(lab.database))))
    for path in old_locks:  # as an earlier gpu-mon made them
        path.write_text("")
        os.chmod(path, 0o644)
    with held_by(lab.bob, *old_locks):
        d = daemon_factory(queue_body(lab), defaults={"state_file": state, "start_delay_seconds": 0})
        wait_for(lambda: d.proc.poll() is not None or lab.socket.exists(), 30, "the queue's socket")
        assert d.proc.poll() is None, d.log()
        assert lock.holder(str(state)) == d.proc.pid
        for path in old_locks:
            st = os.stat(path)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600), path
            assert cannot_open(lab.bob, path)
        job = lab.submit(lab.alice, "--", PY, str(lab.job))
        lab.wait_state(lab.alice, job, "done")
        doc = wait_for(lambda: (s := status(lab, lab.bob, client_conf(lab, state))).get("daemon") and s, 20)
        assert doc["daemon"]["pid"] == d.proc.pid  # a user still tells that the daemon runs (/proc/locks)
    assert "pid unknown" not in d.log()


def test_fresh_locks_are_0600_and_a_user_cannot_open_them(lab, daemon_factory):
    state = lab.dir / "run" / "state.json"
    d = daemon_factory(queue_body(lab), defaults={"state_file": state})
    wait_for(lambda: d.proc.poll() is not None or lab.socket.exists(), 30, "the queue's socket")
    for path in (Path(lock.lock_path(str(state))), Path(lock.lock_path(str(lab.database)))):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
        assert cannot_open(lab.alice, path)


def test_a_queue_that_could_not_start_is_tried_again_and_status_says_why(lab, daemon_factory):
    state = lab.dir / "run" / "state.json"
    other = lock.DaemonLock(str(lab.database))  # as another daemon serving this queue would
    other.acquire()
    try:
        d = daemon_factory(queue_body(lab), defaults={"state_file": state})
        first = d.wait_log(
            r"queue: cannot start the queue: another gpu-mon daemon is running .*; trying again in 5 s"
        )
        assert f"(pid {os.getpid()}; lock {lab.database}.lock)" in first[0]
        conf = client_conf(lab, state)
        doc = wait_for(
            lambda: (s := status(lab, lab.alice, conf)).get("queue") and s, 20, "the queue in status"
        )
        queue = doc["queue"]
        assert queue["not_running"].startswith("another gpu-mon daemon is running (pid ")
        assert 0 <= queue["next_try_seconds"] <= 5 and queue["running"] == []
        text = lab.run(lab.alice, "--config", str(conf), "status").stdout
        assert "Queue: not running: another gpu-mon daemon is running (pid " in text
        assert "; next try in " in text
        d.wait_log(r"queue: cannot start the queue: .*; trying again in 10 s")  # (5 s later: backing off)
        assert len([x for x in d.log().splitlines() if "cannot start the queue" in x]) == 2
    finally:
        other.release()
    d.wait_log(r"queue: listening on ", timeout=30)
    d.wait_log(r"queue: started \(after 2 failed tries\)")
    wait_for(lambda: "not_running" not in (status(lab, lab.alice, conf).get("queue") or {}), 20, "status")
    job = lab.submit(lab.alice, "--", PY, str(lab.job))
    lab.wait_state(lab.alice, job, "done")


def test_an_old_0644_lock_held_by_a_process_of_ours_is_another_daemon_never_replaced(tmp_path):
    state = tmp_path / "state.json"
    path = Path(lock.lock_path(str(state)))
    path.write_text("")
    os.chmod(path, 0o644)
    p = subprocess.Popen([PY, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)  # (root: ours)
    try:
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        with pytest.raises(lock.LockError, match=rf"another gpu-mon daemon is running \(pid {p.pid}; lock "):
            lock.DaemonLock(str(state)).acquire()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # left as it was: that daemon still has it
    finally:
        p.kill()
        p.wait()
    held = lock.DaemonLock(str(state))
    held.acquire()  # no one holds it now: replaced under its lock
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and sorted(os.listdir(tmp_path)) == [path.name]
    finally:
        held.release()
