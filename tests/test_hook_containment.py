"""Nothing a hook started outlives it: a `--notify` hook runs under a leader of its own (the direct
launcher), so a child it `setsid`'d is ended when the hook exits, at its limit, and when gpu-mon stops; a
requeue reaches the hook as `requeued`, not as the end `preempted`; a user's default hook is looked for as
the user; and the hook's output file, when the hook makes it, is the user's alone. Real daemon, real users
made here (their own names: gmhann, gmhben)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest
from conftest import foreign_open, wait_for
from test_hook_turns import _notice as notice
from test_queue import JOB, Lab, made_lab, queue_body
from test_queue_arrays import _alive, _pids

from gpu_mon.queue import hooks
from gpu_mon.queue.hookleader import LeaderHooks

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs hooks as them")

# A hook that leaves a child in a session of its own (SIGTERM ignored by both), its pid in PIDS, then
# exits (`exit 0`) or hangs (`wait`).
ESCAPE = (
    "trap '' TERM; setsid sh -c 'echo $$ >\"$0\"; exec sleep 300' PIDS </dev/null >/dev/null 2>&1 & "
    "while [ ! -s PIDS ]; do sleep 0.05; done; "
)


@pytest.fixture
def hlab(sim) -> Iterator[Lab]:
    with made_lab("gmh", ("gmhann", "gmhben"), JOB) as lab:
        yield lab


def _daemon(lab: Lab, daemon_factory, gpus: str = "ALL"):
    d = daemon_factory(queue_body(lab, gpus=gpus), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    return d


def test_a_child_a_hook_setsid_is_ended_when_the_hook_exits(hlab: Lab, daemon_factory) -> None:
    d = _daemon(hlab, daemon_factory)
    pids = hlab.alice.work / "orphan.pids"
    job = hlab.submit(
        hlab.alice, "--notify", ESCAPE.replace("PIDS", str(pids)) + "exit 0", *hlab.job_cmd("exit", "0")
    )
    (orphan,) = wait_for(lambda: _pids(pids), 30, "the hook's child's pid")
    # SIGTERM ignored: SIGKILL a second (KILL_AFTER) after the hook's end, by its leader
    wait_for(lambda: not _alive(orphan), hooks.KILL_AFTER + 10, "the hook's child gone with the hook")
    d.wait_log(rf"queue: job {job} done: running its hook\[\d+\]")
    assert not re.search(rf"queue: job {job}: its hook", d.log())  # (it exited 0: nothing failed)


def test_a_hanging_hook_and_its_setsid_child_end_when_gpu_mon_stops(hlab: Lab, daemon_factory) -> None:
    d = _daemon(hlab, daemon_factory)
    pids = hlab.alice.work / "orphan.pids"
    job = hlab.submit(
        hlab.alice, "--notify", ESCAPE.replace("PIDS", str(pids)) + "wait", *hlab.job_cmd("exit", "0")
    )
    (orphan,) = wait_for(lambda: _pids(pids), 30, "the hook's child's pid")
    began = time.monotonic()
    assert d.stop() == 0
    assert time.monotonic() - began < hooks.STOP_GRACE + hooks.KILL_AFTER + 8
    assert not _alive(orphan)
    d.wait_log(rf"queue: job {job}: its hook was still running when gpu-mon stopped: killed")


def _notice(job_id: int, uid: int, cmd: str, cwd: str) -> hooks.Notice:
    return notice(job_id, uid, cmd, cwd, "done")


def test_a_hanging_hook_and_its_setsid_child_end_at_its_limit(monkeypatch) -> None:
    # The loop's own Hooks with the daemon's launcher (this process is the "daemon"), a 1 s limit.
    monkeypatch.setattr(hooks, "HOOK_SECONDS", 1.0)
    shared = Path(tempfile.mkdtemp(prefix="gpu-mon-hookleader-"))
    shared.chmod(0o1777)
    keep: Dict[int, object] = {}
    notes = []
    h = hooks.Hooks(
        lambda j: str(shared / "log"),
        lambda u, g: (g,),
        lambda j, t: notes.append(t) or True,
        keep,  # type: ignore[arg-type]
        LeaderHooks(lambda u, g: (g,)).hook,
    )
    try:
        pids = shared / "orphan.pids"
        h.add(_notice(1, 65534, ESCAPE.replace("PIDS", str(pids)) + "wait", str(shared)), time.monotonic())
        h.poll(time.monotonic())
        (orphan,) = wait_for(lambda: _pids(pids), 20, "the hook's child's pid")
        assert _alive(orphan)
        wait_for(lambda: h.poll(time.monotonic()) or not h.running, 20, "the hook ended at its limit")
        assert not _alive(orphan)
        assert notes == ["gpu-mon: job 1: its hook took over 1 s: killed"]
        assert not keep
    finally:
        h.close()
        shutil.rmtree(shared)


def _lines(path: Path) -> list:
    return path.read_text().split() if path.exists() else []


def test_a_requeue_reaches_the_hook_as_requeued_and_an_end_as_preempted(
    hlab: Lab, daemon_factory, sim
) -> None:
    _daemon(hlab, daemon_factory, gpus="0")
    ann = hlab.alice
    states = ann.work / "states"
    hook = f'echo "$GPU_MON_JOB_ID-$GPU_MON_JOB_STATE-$GPU_MON_JOB_EXIT" >>{states}'
    again = hlab.submit(ann, "--notify", hook, *hlab.job_cmd("forever"))
    hlab.wait_running(ann, again)
    with foreign_open(sim.device(0)):
        wait_for(lambda: f"{again}-requeued-143" in _lines(states), 30, "the requeue's notice")
        hlab.run(ann, "cancel", str(again))
        wait_for(lambda: len(_lines(states)) > 1, 30, "the cancel's notice")
    ended = hlab.submit(ann, "--no-requeue", "--notify", hook, *hlab.job_cmd("forever"))
    hlab.wait_running(ann, ended)
    with foreign_open(sim.device(0)):
        wait_for(lambda: f"{ended}-preempted-143" in _lines(states), 30, "the end's notice")
    assert _lines(states)[:2] == [f"{again}-requeued-143", f"{again}-cancelled-143"]
    assert _lines(states)[2:] == [f"{ended}-preempted-143"]


def test_a_default_hook_only_root_could_see_is_as_missing(hlab: Lab, daemon_factory) -> None:
    d = _daemon(hlab, daemon_factory)
    ann = hlab.alice
    private = Path(tempfile.mkdtemp(prefix="gpu-mon-rootonly-"))  # (0700, root's)
    try:
        (private / "notify").write_text("#!/bin/sh\nexit 0\n")
        (private / "notify").chmod(0o755)
        config = ann.home / ".config" / "gpu-mon"
        config.mkdir(parents=True)
        for path in (config.parent, config):
            os.chown(path, ann.uid, ann.gid)
        os.symlink(private / "notify", config / "notify")
        os.lchown(config / "notify", ann.uid, ann.gid)
        first = hlab.submit(ann, *hlab.job_cmd("exit", "0"))
        mark = ann.work / "second-hook"
        second = hlab.submit(ann, "--notify", f"touch {mark}", *hlab.job_cmd("exit", "0"))
        wait_for(mark.exists, 30, "the second job's hook (one user's hooks run in order)")
        d.wait_log(rf"queue: job {second} done: running its hook")
        assert not re.search(rf"job {first}\b.*hook", d.log()), d.log()
    finally:
        shutil.rmtree(private)


def test_the_file_a_hook_makes_for_its_output_is_the_users_alone(hlab: Lab, daemon_factory) -> None:
    _daemon(hlab, daemon_factory)
    ann = hlab.alice
    out = ann.work / "held.log"
    job = hlab.submit(
        ann, "--hold", "--output", str(out), "--notify", "echo from the hook", *hlab.job_cmd("exit", "0")
    )
    hlab.run(ann, "cancel", str(job))
    wait_for(lambda: out.exists() and "from the hook" in out.read_text(), 30, "the hook's output")
    st = out.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (ann.uid, 0o600)
