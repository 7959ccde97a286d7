"""A plain user's open/close loop on the node of a GPU with nothing of ours on it (issue 46, item 3): the
daemon lets that node go and looks at it about once a second (engine/floods.py), not at every open; the
log says busy, sums the episode up and says free, once each, and the history has an interval or two for
it, while an open of the GPU where a workload runs stops that workload at once, as ever. A real daemon
with a flood by `nobody`, and the yield path in-process (no daemon) for the steps. Bounds, not timings."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import WORKLOAD_PYTHON, foreign_open, workload_cmd
from test_policy import U0, U1, config, holder, snap
from test_yieldpath import KEY, _at_work, _event

from gpu_mon.api.model import OpenFlood, QueueJob
from gpu_mon.engine.floods import HOLD_SECONDS
from gpu_mon.policy import decide as policy
from gpu_mon.policy import words
from gpu_mon.policy.decisions import Busy, PolicyState

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="floods as nobody and reads every process")
FLOOD_SECONDS = 4.0  # how long the flood runs: the load, not a wait for a result
# As fast as Python goes; says how many opens when stopped (SIGTERM)
FLOOD = r"""
import os, signal, sys
n = 0
def done(*_):
    print(n, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
print("flooding", flush=True)
while True:
    os.close(os.open(sys.argv[1], os.O_RDONLY))
    n += 1
"""
# Opens and closes the node when told (a line on stdin), and lives on: the kernel names it as the opener
OPENER = r"""
import os, sys
for line in sys.stdin:
    os.close(os.open(sys.argv[1], os.O_RDONLY))
    print("done", flush=True)
"""


def _rows(database: Path, sql: str, *args: object) -> List[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        return db.execute(sql, args).fetchall()


@root_only
def test_a_flood_of_opens_on_an_idle_gpu_is_said_once_and_a_workload_elsewhere_still_yields_at_once(
    tmp_path, sim, daemon_factory, public_dir
):
    node = public_dir / "nvidia0"  # (nobody cannot reach into pytest's directories)
    node.touch(mode=0o666)
    sim.set(0, device=str(node))
    body = f"[gpu-all]\ngpus = ALL\n[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = 1\nuser = root\n"
    # (polls 30 s apart: only the open event can stop the miner within the test's deadline)
    d = daemon_factory(body, defaults={"interval_seconds": 30, "start_delay_seconds": 0.2})
    d.wait_log(r"starting miner\[")  # (the state file has its pid at the next round: 30 s)
    nobody = pwd.getpwnam("nobody")
    flood = subprocess.Popen(
        [WORKLOAD_PYTHON, "-c", FLOOD, str(node)],
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout is not None and flood.stdout.readline() == "flooding\n"
        began = time.monotonic()
        d.wait_log(r"GPU 0 \(.*\) busy: .*nobody python3")
        with foreign_open(sim.device(1)) as other:  # the other GPU, in the middle of the flood
            d.wait_log(rf"GPU 1 \(.*\) busy: .*\[{other.pid}\] holds .*; stopping miner", timeout=5)
        time.sleep(max(0.0, began + FLOOD_SECONDS - time.monotonic()))
    finally:
        flood.send_signal(signal.SIGTERM)
        opens = int(flood.communicate(timeout=20)[0].strip() or 0)
    assert opens > 10_000, opens  # (a flood indeed: the old daemon said busy and free ~40 times a second)
    d.wait_log(r"GPU 0 \(.*\): opened and closed again and again for \d+ s by nobody python3\[")
    d.wait_log(r"GPU 0 \(.*\) free$")
    d.stop()
    said = [line for line in d.log().splitlines() if "GPU 0 (" in line]
    assert len(said) <= 4, said  # busy, the summing-up, free (and a busy by another reason at most)
    history = tmp_path / "history.sqlite"
    intervals = _rows(history, "SELECT state, users FROM intervals WHERE uuid = ?", sim.uuid(0))
    assert len(intervals) <= 6 and ("foreign", "nobody") in intervals, intervals
    preemptions = _rows(history, "SELECT uuid, detected_by FROM preemptions")
    assert preemptions == [(sim.uuid(1), "open")], preemptions


@contextlib.contextmanager
def _opener(device: str) -> Iterator[subprocess.Popen]:
    p = subprocess.Popen(
        [WORKLOAD_PYTHON, "-c", OPENER, device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _open_once(r, yp, opener: subprocess.Popen, now: float) -> None:
    """The opener opens and closes the node once; the yield path takes that open (one wake)."""
    assert opener.stdin is not None and opener.stdout is not None
    opener.stdin.write("open\n")
    opener.stdin.flush()
    assert opener.stdout.readline() == "done\n"
    _event(r)
    r.p.yields.woke(now)
    assert yp.on_wake(now) is True


@root_only
def test_a_second_open_within_a_second_lets_the_node_go_and_the_gpu_counts_busy_till_it_ends(tmp_path):
    with _at_work(tmp_path) as (r, yp, sim), _opener(sim.device(1)) as opener:
        node, uuid = sim.device(1), sim.uuid(1)
        now = time.monotonic()
        _open_once(r, yp, opener, now)  # the first: looked at as ever
        assert r.p.floods.episodes == {} and node in r.p.opens.watching()
        _open_once(r, yp, opener, now + 0.1)  # the second within HOLD_SECONDS: an episode
        assert node not in r.p.opens.watching() and node in r.p.opens.held
        reasons = r.report.decision.verdicts[uuid].reasons
        assert [x.who.pid for x in reasons if x.kind == Busy.OPENS] == [opener.pid], reasons
        assert r.p.floods.deadline() == pytest.approx(now + 0.1 + HOLD_SECONDS)
        r.p.opens.read()  # (what the watch's removal queued: its IN_IGNORED, read as nobody's)
        opener.stdin.write("open\n")  # let go: no event at all
        opener.stdin.flush()
        assert opener.stdout.readline() == "done\n"
        assert not r.p.opens.inotify.pending(0.05)
        assert not r.p.supervisor.workloads[KEY].stopping  # (GPU 0's workload: nothing of GPU 1's stops it)
        yp.on_wake(now + 0.1 + HOLD_SECONDS)  # watched again, still an episode
        assert node in r.p.opens.watching() and r.report.decision.verdicts[uuid].busy
        assert yp.on_wake(now + 0.1 + 2 * HOLD_SECONDS) is True  # no open since: over, and a round says so
        assert r.p.floods.episodes == {} and not r.report.decision.verdicts[uuid].busy
        assert not any("opens looked at" in s["text"] for s in r.said)  # (one look: too short to sum up)


@root_only
def test_a_gpu_let_go_is_watched_again_once_something_of_ours_is_on_it(tmp_path):
    with _at_work(tmp_path) as (r, yp, sim), _opener(sim.device(1)) as opener:
        node, uuid = sim.device(1), sim.uuid(1)
        now = time.monotonic()
        _open_once(r, yp, opener, now)
        _open_once(r, yp, opener, now + 0.1)
        assert node not in r.p.opens.watching()
        # A job of ours on GPU 1 now (as a Slurm or an occupy's queue job is seen: in the round's snapshot)
        snap = dataclasses.replace(r.report.snapshot, queue_jobs=(QueueJob(7, "ann", "", (uuid,)),))
        r.report = dataclasses.replace(r.report, snapshot=snap)
        yp.guard()
        assert node in r.p.opens.watching() and r.p.floods.episodes == {}
        assert yp.deadline() == 0.0 and node in r.p.opens.opened  # looked at at once, as if opened
        _open_once(r, yp, opener, now + 0.2)  # and every open of it again, one by one
        assert r.p.floods.episodes == {} and node in r.p.opens.watching()


@pytest.mark.parametrize(
    ("opener", "gpu_section", "reason"),
    [
        (holder(9, name="python3"), "", "opened and closed again and again by alice python3[9]"),
        (holder(9, name="nvidia-smi", user="root", monitor=True), "", None),  # a monitor: never busy
        (holder(9, user="bob"), "ignore_users = bob\n", None),
        (holder(9, name="probe"), "ignore_programs = probe\n", None),
    ],
)
def test_a_gpu_opened_again_and_again_is_busy_by_whoever_opens_it_unless_ignored(opener, gpu_section, reason):
    conf = config(f"[gpu-all]\ngpus = ALL\n{gpu_section}[process-m]\ncmd = m\nuser = root\n")
    plan = policy.resolve(conf, snap().reading.gpus)
    flood = OpenFlood(U0, 50.0, (opener,))
    d = policy.decide(conf, plan, snap(open_floods=(flood,)), PolicyState())
    said = [words.reason(r) for r in d.verdicts[U0].reasons]
    assert said == ([reason] if reason else []) and not d.verdicts[U1].busy
    # An opener that holds the node now is said as a holder, once
    held = policy.decide(conf, plan, snap(holders=(opener,), open_floods=(flood,)), PolicyState())
    assert all(r.kind != Busy.OPENS for r in held.verdicts[U0].reasons)
