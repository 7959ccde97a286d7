"""A flood of notices is not a flood of processes: hooks wait their turn (at most MAX_STARTS started in one
look, MAX_RUNNING at once, MAX_PER_USER of one user's), another user's hook is not held up behind one
user's thousand, every waiting hook runs once, and those still waiting when gpu-mon stops are not run.
Real hooks (/bin/sh, as root and as nobody), run by the same Hooks the daemon uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from conftest import wait_for

from gpu_mon.queue import hooks
from gpu_mon.queue.jobs import Job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs hooks as another user: needs root")

NOBODY = 65534


def _notice(job_id: int, uid: int, cmd: str, cwd: str, state: str = "cancelled") -> hooks.Notice:
    job = Job(
        id=job_id,
        user=str(uid),
        uid=uid,
        gid=uid,
        command=("true",),
        cwd=cwd,
        env=(("PATH", "/usr/bin:/bin"),),
        output="",
        submitted=0.0,
        notify=(cmd,),
    )
    return hooks.Notice(job, state, None)


def _hooks(logs: Path) -> hooks.Hooks:
    keep: Dict[int, object] = {}
    return hooks.Hooks(lambda j: str(logs / f"{j.id}.log"), lambda u, g: (g,), lambda j, t: True, keep)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may write (pytest's own are root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gpu-mon-hooks-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def test_a_flood_of_one_users_hooks_runs_in_turns_beside_anothers(shared: Path) -> None:
    tmp_path = shared  # (nobody's hooks write here)
    gate = tmp_path / "gate"  # every hook waits for it: what runs at once can be counted
    cmd = f'while [ ! -e {gate} ]; do sleep 0.01; done; echo "$GPU_MON_JOB_ID" >>{tmp_path}/ran-$(id -u)'
    h = _hooks(tmp_path)
    flood = [_notice(i, 0, cmd, str(tmp_path)) for i in range(1, 41)]  # root's 40
    others = [_notice(100 + i, NOBODY, cmd, str(tmp_path)) for i in range(2)]  # nobody's 2, behind them
    try:
        for n in flood + others:
            h.add(n, time.monotonic())
        assert not h.running  # (nothing starts before the loop looks)
        h.poll(time.monotonic())
        by_user = sorted(r.job.uid for r in h.running)
        assert by_user == [0, NOBODY], by_user  # (MAX_STARTS a look, the users in turn)
        for _ in range(hooks.MAX_PER_USER):
            h.poll(time.monotonic())
        by_user = sorted(r.job.uid for r in h.running)
        assert by_user == [0] * hooks.MAX_PER_USER + [NOBODY] * 2, by_user
        assert h.next_poll(0.0) == hooks.TURN_SECONDS  # (hooks wait: the loop looks again soon)
        h.poll(time.monotonic())
        assert len(h.running) == hooks.MAX_PER_USER + 2  # nobody started more while they run
        gate.touch()
        most = 0

        def all_ran() -> bool:
            nonlocal most
            h.poll(time.monotonic())
            most = max(most, sum(1 for r in h.running if r.job.uid == 0))
            return not h.running and not h.waiting

        wait_for(all_ran, 60, "every hook run", interval=0.05)
        assert most <= hooks.MAX_PER_USER
        ids: List[int] = sorted(int(x) for f in tmp_path.glob("ran-*") for x in f.read_text().split())
        assert sorted((tmp_path / f"ran-{NOBODY}").read_text().split()) == ["100", "101"]  # (as nobody)
        assert ids == [*range(1, 41), 100, 101]  # each once
        assert h.next_poll(0.0) is None
    finally:
        h.close()


def test_one_look_starts_at_most_max_starts_and_a_stop_drops_those_waiting(shared: Path, caplog) -> None:
    h = _hooks(shared)
    users = [1000 + u for u in range(6)]  # (no such users needed: a hook runs with their ids)
    try:
        for uid in users:
            for i in range(5):
                h.add(_notice(uid * 10 + i, uid, "sleep 30", "/"), time.monotonic())
        h.poll(time.monotonic())
        assert len(h.running) == hooks.MAX_STARTS
        for _ in range(hooks.MAX_RUNNING):
            h.poll(time.monotonic())
        assert len(h.running) == hooks.MAX_RUNNING < len(users) * 5
        assert max(Counter(r.job.uid for r in h.running).values()) <= hooks.MAX_PER_USER
        waiting = len(users) * 5 - hooks.MAX_RUNNING
        h.stopping(time.monotonic())
        assert not h.waiting and f"{waiting} hook(s) waiting to run are not run" in caplog.text
        h.poll(time.monotonic())
        assert len(h.running) == hooks.MAX_RUNNING  # (nothing new starts)
    finally:
        h.close()
    assert not h.running


def test_a_hook_whose_log_cannot_be_opened_still_runs(shared: Path) -> None:
    """(dash ends a shell whose `exec >>LOG` fails, status 2: the hook must run with its output dropped)"""
    h = _hooks(shared / "no" / "such" / "directory")
    ran = shared / "ran"
    try:
        h.add(_notice(7, NOBODY, f"echo ran >{ran}; echo lost", "/"), time.monotonic())
        h.poll(time.monotonic())
        assert len(h.running) == 1
        wait_for(lambda: h.poll(time.monotonic()) or not h.running, 20, "the hook to end")
        assert ran.read_text() == "ran\n" and ran.stat().st_uid == NOBODY
    finally:
        h.close()


def test_the_bench_prints_its_table_beside_the_baseline() -> None:
    bench = Path(__file__).resolve().parent.parent / "bench" / "hooks.py"
    r = subprocess.run(
        [sys.executable, str(bench), "--notices", "20"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    rows = {line[:34].strip(): line[34:].split() for line in r.stdout.splitlines()[2:]}
    assert rows["hooks running at once, at most"] == ["21", "2"], r.stdout
    assert set(rows) >= {"longest look of the loop", "until the other user's hook runs"}, r.stdout


def test_a_job_that_came_and_ended_between_two_looks_is_notified_and_what_was_before_is_not() -> None:
    """Notices compares each look with the last: a job submitted and cancelled in between (never seen
    unended) still gets its hook, requeued, ended or not; only the first look's past is no news."""
    import dataclasses

    from gpu_mon.queue import jobs as J

    old = dataclasses.replace(_notice(1, 1000, "true", "/").job, state=J.DONE, exit_status=0)
    notices = hooks.Notices()
    assert notices.changes([old], 1) == []  # ended before gpu-mon looked: not news
    waiting = _notice(2, 1000, "true", "/").job
    assert notices.changes([old, waiting], 2) == []
    came_and_went = dataclasses.replace(_notice(3, 1000, "true", "/").job, state=J.CANCELLED)
    ended = dataclasses.replace(waiting, state=J.CANCELLED)
    said = notices.changes([old, ended, came_and_went], 3)
    assert [(n.job.id, n.state) for n in said] == [(2, J.CANCELLED), (3, J.CANCELLED)]
    assert notices.changes([old, ended, came_and_went], 4) == []  # each end once
