"""The queue's everyday conveniences: `cancel`/`hold`/`release` by --name, --state and --all (root: --user),
resolved by the daemon from the peer's credentials; `gpu-mon queue drain|resume`, kept in the queue's
database across a restart and shown in `jobs` and `status`; the END of finished jobs in `jobs --all`.
The pure parts, then the real daemon on simulated GPUs with users made here (gmdcarol, gmddave: other
queue tests use their own names)."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from conftest import GPU_MON, wait_for
from test_queue import PY, Lab, User, made_lab, queue_body

from gpu_mon.config import QueueSection
from gpu_mon.outputs.status import queue_line
from gpu_mon.queue import placement
from gpu_mon.queue import words as queue_words
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.store import Drained, Store

JOB = r"""
import os, sys, time
time.sleep(float(sys.argv[1]))
"""

# ------------------------------------------------------------------ pure: placement, words, the store


def _job(job_id: int, **kw) -> Job:
    fields = dict(id=job_id, user="ann", uid=1000, gid=1000, command=("true",), cwd="/tmp", env=(), output="")
    fields.update(submitted=float(job_id), **kw)
    return Job(**fields)  # type: ignore[arg-type]


def test_a_drained_placement_starts_nothing_and_says_so_while_running_jobs_go_on() -> None:
    gpus = [
        placement.GpuView("GPU-a", False, free_since=0.0),
        placement.GpuView("GPU-b", False, free_since=0.0),
    ]
    running = _job(1, state="running", gpus=("GPU-a",), started=1.0)
    jobs = [running, _job(2), _job(3, state="held")]
    q = QueueSection()
    open_ = placement.place(jobs, gpus, q, 0.0, 100.0, 100.0)
    assert [s.job for s in open_.starts] == [2]
    drained = placement.place(jobs, gpus, q, 0.0, 100.0, 100.0, drained=True)
    assert drained.starts == () and drained.preempt_workloads == ()
    assert drained.waiting == {2: placement.Waiting("drained")}
    assert drained.claimed == {"GPU-a": 1}  # the running job keeps its GPU; no queued job claims one
    assert queue_words.waiting(drained.waiting[2], "ann", {}, 100.0) == "waiting: queue drained"
    busy = [placement.GpuView("GPU-a", True)]
    assert [p.job for p in placement.place(jobs, busy, q, 0.0, 1.0, 1.0, drained=True).preempt_jobs] == [1]


def test_the_drained_line_in_status() -> None:
    day = time.localtime()
    at = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, 14, 2, 0, 0, 0, -1))
    doc = {"jobs": {"running": 1, "queued": 3}, "drained": {"by": "root", "at_wall": at}}
    assert queue_line(doc).splitlines() == [
        "Queue: 1 running, 3 queued, 0 held (gpu-mon jobs lists them)",
        "queue drained by root at 14:02: no job starts (gpu-mon queue resume)",
    ]
    assert "\n" not in queue_line({"jobs": {}})
    before = time.mktime((2020, 1, 2, 14, 2, 0, 0, 0, -1))
    assert queue_words.drained("root", before).startswith("queue drained by root at 2020-01-02 14:02: ")


def test_a_drain_is_on_disk_and_a_file_from_before_drains_gets_its_table(tmp_path: Path) -> None:
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, time.time())
    assert store.drained is None
    store.submit(_job(0), 10)
    version = store.version
    store.drain(Drained("root", 1234.5))
    assert store.version > version  # (the daemon places again)
    store.close()
    again = Store.open(path, time.time())
    assert again.drained == Drained("root", 1234.5) and len(again.all()) == 1
    again.drain(None)
    again.close()
    assert Store.open(path, time.time()).drained is None
    # a queue written before drains existed (no queue_state table): kept, with the table added
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE queue_state")
    conn.commit()
    conn.close()
    old = Store.open(path, time.time())
    assert old.drained is None and len(old.all()) == 1
    old.drain(Drained("root", 1.0))
    old.close()
    # a value this version cannot read still drains: the admin asked for no starts
    conn = sqlite3.connect(path)
    conn.execute("UPDATE queue_state SET value = 'garbage' WHERE key = 'drained'")
    conn.commit()
    conn.close()
    assert Store.open(path, time.time()).drained == Drained("?", 0.0)


# ------------------------------------------------------------------ the real daemon

pytestmark_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them")


@pytest.fixture
def clab(sim):
    """Two users of our own (gmdcarol, gmddave), the package where they can read it, the job script and
    the client's config; all removed afterwards."""
    with made_lab("gmd", ("gmdcarol", "gmddave"), JOB) as lab:
        yield lab


def _root(lab: Lab) -> User:
    return User("root", 0, 0, lab.dir)  # (its `work`, lab.dir/work, is made by the test)


def _one_line(r: subprocess.CompletedProcess, code: int, says: str) -> None:
    assert (r.returncode, r.stdout) == (code, ""), (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu-mon: ") and says in r.stderr, r.stderr


def _states(lab: Lab, user: User, owner: str) -> dict:
    return {i: j["state"] for i, j in lab.jobs(user).items() if j["user"] == owner}


@pytestmark_root
def test_cancel_hold_release_by_name_state_and_all_are_the_users_own_and_root_needs_user(
    clab, daemon_factory
):
    lab = clab
    (lab.dir / "work").mkdir()
    root, carol, dave = _root(lab), lab.alice, lab.bob
    daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    sleep = ["--", PY, str(lab.job), "600", lab.marker]
    running = lab.submit(carol, "--name", "long", *sleep)
    lab.wait_state(carol, running, "running")
    sweep = lab.submit(carol, "--name", "sweep", "--array", "0-3", *sleep)
    others = [lab.submit(carol, "--name", "other", *sleep) for _ in range(2)]
    daves = [lab.submit(dave, "--name", "sweep", *sleep) for _ in range(2)]
    # usage: IDs or a selection, one of them
    _one_line(lab.run(carol, "cancel"), 2, "cancel: name the jobs: IDs, or --name, --state or --all")
    _one_line(lab.run(carol, "cancel", "--user", "gmdcarol"), 2, "(--user only narrows them)")
    _one_line(lab.run(carol, "cancel", str(sweep), "--all"), 2, "give job IDs or a selection")
    # by name: only her own (dave's jobs of the same name stay), a whole array at once, one answer
    r = lab.run(carol, "cancel", "--name", "sweep")
    assert (r.returncode, r.stdout, r.stderr) == (0, "cancelled 4 jobs\n", "")
    states = _states(lab, carol, "gmdcarol")
    assert [states[i] for i in range(sweep, sweep + 4)] == ["cancelled"] * 4
    assert _states(lab, dave, "gmddave") == {i: "queued" for i in daves}
    _one_line(lab.run(carol, "cancel", "--name", "sweep"), 1, "cancel: 4 jobs of yours match --name 'sweep'")
    _one_line(lab.run(carol, "cancel", "--name", "nope"), 1, "cancel: no job of yours matches --name 'nope'")
    # --all: hold applies to the queued ones only; release by state
    r = lab.run(carol, "hold", "--all")
    assert (r.returncode, r.stdout) == (0, "held 2 jobs\n"), r.stderr
    assert [_states(lab, carol, "gmdcarol")[i] for i in (running, *others)] == ["running", "held", "held"]
    r = lab.run(carol, "release", "--state", "held")
    assert (r.returncode, r.stdout) == (0, "released 2 jobs\n"), r.stderr
    _one_line(lab.run(carol, "release", "--all"), 1, "none to release")
    # another user's jobs: never by a user, whatever the client sends
    _one_line(
        lab.run(carol, "cancel", "--all", "--user", "gmddave"), 1, "only root may select another user's"
    )
    assert _states(lab, dave, "gmddave") == {i: "queued" for i in daves}
    # root without --user selects only its own jobs: a slip never cancels everyone's
    _one_line(lab.run(root, "cancel", "--all"), 1, "cancel: no job of yours matches --all")
    assert set(_states(lab, dave, "gmddave").values()) == {"queued"}
    r = lab.run(root, "hold", "--all", "--user", "gmddave")
    assert (r.returncode, r.stdout) == (0, "held 2 jobs\n"), r.stderr
    # a running job: stopped with its signal and grace; the answer says so
    r = lab.run(carol, "cancel", "--state", "running")
    assert (r.returncode, r.stdout) == (0, "cancelled 1 job (1 running: stopping)\n"), r.stderr
    lab.wait_state(carol, running, "cancelled")
    r = lab.run(root, "cancel", "--all", "--user", "*")  # carol's 2 others (one may run now), dave's 2
    assert r.returncode == 0 and r.stdout.startswith("cancelled 4 jobs"), r.stdout + r.stderr
    assert set(_states(lab, root, "gmddave").values()) == {"cancelled"}
    # jobs --all: when each ended
    table = lab.run(carol, "jobs", "--all").stdout.splitlines()
    assert table[0].split()[:6] == ["ID", "USER", "STATE", "GPUS", "TIME", "END"], table
    cells = re.split(r"\s{2,}", next(t for t in table if t.startswith(f"{running} ")))
    assert cells[2] == "cancelled" and cells[4] != "-" and re.fullmatch(r"\d\d:\d\d:\d\d", cells[5]), cells
    cells = re.split(r"\s{2,}", next(t for t in table if t.startswith(f"{sweep}_[")))
    assert cells[2] == "cancelled" and cells[4] == "-", cells  # (it never ran: no TIME, but an END)
    assert re.fullmatch(r"\d\d:\d\d:\d\d", cells[5]), cells
    queued_only = lab.run(carol, "jobs").stdout
    assert "END" not in queued_only.splitlines()[0]


@pytestmark_root
def test_a_drain_stops_new_starts_lasts_across_a_restart_and_shows_in_jobs_and_status(clab, daemon_factory):
    lab = clab
    (lab.dir / "work").mkdir()
    root, carol = _root(lab), lab.alice
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    running = lab.submit(carol, "--", PY, str(lab.job), "600", lab.marker)
    lab.wait_state(carol, running, "running")
    _one_line(lab.run(carol, "queue", "drain"), 1, "queue drain: only root may drain or resume the queue")
    r = lab.run(root, "queue", "drain")
    drained = re.compile(r"^queue drained by root at \d\d:\d\d: no job starts \(gpu-mon queue resume\)$")
    assert r.returncode == 0 and drained.match(r.stdout.strip()), r.stdout + r.stderr
    r = lab.run(root, "queue", "drain")
    assert r.stdout.startswith("already drained by root at "), r.stdout
    # the running job goes on; a new one waits, and says why
    waiting = lab.submit(carol, "--", PY, str(lab.job), "0", lab.marker)
    r = lab.run(carol, "cancel", str(running))
    assert r.returncode == 0, r.stderr
    lab.wait_state(carol, running, "cancelled")
    wait_for(lambda: lab.jobs(carol)[waiting]["reason"] == "waiting: queue drained", 20, "the drain's reason")
    lines = lab.run(carol, "jobs").stdout.splitlines()
    assert drained.match(lines[0]) and "waiting: queue drained" in lines[2], lines
    out = json.loads(lab.run(carol, "jobs", "--json").stdout)
    assert out["drained"]["by"] == "root" and out["jobs"][0]["id"] == waiting
    state = wait_for(lambda: (d.state().get("queue") or {}).get("drained"), 20, "status's drained")
    assert state["by"] == "root"  # type: ignore[index]
    r = subprocess.run([*GPU_MON, "--config", str(d.config_path), "status"], capture_output=True, text=True)
    text = r.stdout
    assert re.search(r"^queue drained by root at \d\d:\d\d: no job starts", text, re.M), text
    # across a restart: still drained, and the log says so
    d.signal(signal.SIGTERM)
    d.proc.wait(20)  # type: ignore[union-attr]
    d.start()
    d.wait_log(r"queue: drained by root at .*: no job starts until `gpu-mon queue resume`")
    wait_for(lab.socket.exists, 20, "the queue's socket again")
    d.poll_passed()
    assert lab.jobs(carol)[waiting]["state"] == "queued"
    r = lab.run(root, "queue", "resume")
    assert (r.returncode, r.stdout) == (0, "queue resumed: jobs start again\n"), r.stderr
    lab.wait_state(carol, waiting, "done")
    assert lab.run(root, "queue", "resume").stdout == "queue is not drained\n"
    assert "drained" not in lab.run(carol, "jobs").stdout
    wait_for(lambda: "drained" not in (d.state().get("queue") or {"drained": 1}), 20, "status not drained")
