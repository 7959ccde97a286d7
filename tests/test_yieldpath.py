"""The yield path in-process, without a daemon: the parts a daemon wires (engine/round.py Parts) made here,
a real workload started by the round, a real process that opens the GPU's node, and
engine/yieldpath.py taking the open from the inotify event to the stop signal and what it owes after."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Iterator, Tuple

import pytest
from conftest import SimHost

from gpu_mon import config as config_mod
from gpu_mon.api.observe import Observer
from gpu_mon.api.sim import SimBackend
from gpu_mon.engine.idlecommand import IdleCommands
from gpu_mon.engine.idleround import IdleRound
from gpu_mon.engine.loop import Loop
from gpu_mon.engine.openers import Openers
from gpu_mon.engine.opens import OpenWatch
from gpu_mon.engine.round import Parts, Round
from gpu_mon.engine.scanclock import ScanClock
from gpu_mon.engine.workloads import stopping
from gpu_mon.engine.workloads.supervisor import Supervisor
from gpu_mon.engine.yieldpath import YieldPath
from gpu_mon.engine.yields import Yields

KEY = "burn"


def _config(tmp_path: Path, extra: str = "") -> config_mod.Config:
    text = (
        f"[defaults]\nstate_file = {tmp_path}/state.json\nstart_delay_seconds = 0\ninterval_seconds = 30\n"
        f"[gpu-all]\ngpus = ALL\n{extra}"
        "[process-burn]\ngpus = 0\ncmd = sleep 600\nuser = root\n"
    )
    return config_mod.parse(text, str(tmp_path / "gpu_mon.conf"))


def _parts(cfg: config_mod.Config, sim: SimHost) -> Tuple[Round, YieldPath]:
    loop = Loop()
    obs = Observer(SimBackend(str(sim.path)))
    opens = OpenWatch(obs)
    opens.start(loop.add_reader, cfg.defaults.interval_seconds)
    openers = Openers(obs)
    obs.after_scan = lambda: openers.scanned(opens.pending)
    sup = Supervisor(loop.selector, stopping.rule_for(None, cfg.defaults))
    yields = Yields(time.monotonic, time.time)
    idle = IdleRound(IdleCommands(sup.spawn_helper))
    parts = Parts(obs, sup, opens, openers, ScanClock(cfg.defaults), yields, idle, loop)
    r = Round(cfg, parts, time.time)
    return r, YieldPath(r)


@contextlib.contextmanager
def _at_work(tmp_path: Path, extra: str = "") -> Iterator[Tuple[Round, YieldPath, SimHost]]:
    """A round that has started the workload on GPU 0; everything stopped after."""
    sim = SimHost(tmp_path, 2)
    r, yp = _parts(_config(tmp_path, extra), sim)
    r.p.observer.read_gpus()
    r.p.opens.rewatch()
    r.run(time.monotonic(), scan="full")
    assert KEY in r.p.supervisor.workloads, r.said
    try:
        yield r, yp, sim
    finally:
        sup = r.p.supervisor
        sup.stop_all("test over", time.monotonic())
        sup.kill_all_now(time.monotonic())
        _pump(r, lambda: not sup.busy())
        r.p.opens.stop(r.p.loop.remove_reader)
        r.p.loop.close()


@pytest.fixture
def path_at_work(tmp_path: Path) -> Iterator[Tuple[Round, YieldPath, SimHost]]:
    with _at_work(tmp_path) as made:
        yield made


@contextlib.contextmanager
def _opened(r: Round, yp: YieldPath, device: str) -> Iterator[subprocess.Popen]:
    """Someone else opens `device` and keeps it; the yield path takes the open (one wake)."""
    other = _holder(device)
    try:
        _event(r)
        r.p.yields.woke(time.monotonic())
        assert yp.on_wake(time.monotonic()) is True
        yield other
    finally:
        other.kill()
        other.wait()


def _pump(r: Round, done, timeout: float = 10.0) -> None:
    """Run the supervisor's part of the loop (exits, stop deadlines) until `done()`."""
    sup, deadline = r.p.supervisor, time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        now = time.monotonic()
        for kind, name in r.p.loop.wait((sup.next_deadline(now), now + 0.05), now):
            sup.dispatch(kind, name, time.monotonic())
        sup.tick(time.monotonic())


def _holder(device: str) -> subprocess.Popen:
    """Someone else's process that opens the GPU's node and keeps it (it says so on stdout)."""
    p = subprocess.Popen(
        ["sh", "-c", f"exec 3<{device}; echo opened; exec sleep 600"], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline() == "opened\n"
    return p


def _event(r: Round) -> None:
    assert r.p.opens.inotify is not None and r.p.opens.inotify.pending(5.0)
    r.p.opens.read()


def test_a_foreign_open_stops_the_workload_before_the_round_and_the_round_says_it(path_at_work):
    r, yp, sim = path_at_work
    w = r.p.supervisor.workloads[KEY]
    with _opened(r, yp, sim.device(0)) as other:
        assert w.stopping and w.urgent  # the stop signal went out, with the urgent grace
        said = [s["text"] for s in r.said]
        assert any(f"[{other.pid}]" in t and f"stopping {w.label}[{w.pid}]" in t for t in said), said
        assert r.p.yields.first == {}  # logged by the round, owed no more
        ledger = r.p.yields.yielding[KEY]
        assert ledger["by"] == "open" and ledger["uuid"] == sim.uuid(0)
        _pump(r, lambda: KEY not in r.p.supervisor.workloads)
        r.run(time.monotonic(), scan=None)
        assert r.report is not None
        (gone,) = r.report.preemptions  # recorded once its workload is gone
        assert gone.workload == w.label and gone.detected_by == "open" and gone.term_ms < gone.gone_ms
        assert KEY not in r.p.yields.yielding


def test_an_open_of_the_other_gpu_stops_nothing(path_at_work):
    r, yp, sim = path_at_work
    with _opened(r, yp, sim.device(1)):
        assert not r.p.supervisor.workloads[KEY].stopping
        assert r.report is not None and r.report.decision.verdicts[sim.uuid(1)].busy
        assert yp.retry is None  # explained: the holder was found
        assert r.p.scans.deferred_full is not None  # confirmed by a full scan soon all the same


def test_an_open_nobody_holds_any_more_is_looked_at_again(path_at_work):
    r, yp, sim = path_at_work
    with open(sim.device(0)):
        pass  # opened and closed before any scan: no holder explains it
    _event(r)
    now = time.monotonic()
    r.p.yields.woke(now)
    yp.on_wake(now)
    assert not r.p.supervisor.workloads[KEY].stopping
    assert yp.retry is not None and yp.retry.uuids == {sim.uuid(0)}
    assert yp.deadline() == yp.retry.at
    # Its looks again, each later, until every delay is used
    steps = 0
    while yp.retry is not None:
        at = yp.retry.at
        assert yp.on_wake(at) is True
        steps += 1
    assert steps == 6 and not r.p.supervisor.workloads[KEY].stopping


def test_an_ignored_user_opening_the_gpu_stops_nothing(tmp_path: Path):
    with _at_work(tmp_path, "ignore_users = root\n") as (r, yp, sim), _opened(r, yp, sim.device(0)):
        assert not r.p.supervisor.workloads[KEY].stopping
        assert r.p.yields.yielding == {}


def test_a_look_again_gives_way_to_a_new_open_and_goes_on_after_it(path_at_work):
    """A look again at an open nobody holds reads every process that changed: it pauses for the next open
    (which stops the workload at once) and is not forgotten for it."""
    r, yp, sim = path_at_work
    crowd = [subprocess.Popen(["sleep", "600"]) for _ in range(40)]  # (more than a scan reads between pauses)
    try:
        with open(sim.device(1)):
            pass  # opened and closed before any scan: no holder explains it
        _event(r)
        now = time.monotonic()
        r.p.yields.woke(now)
        yp.on_wake(now)
        assert yp.retry is not None and yp.retry.uuids == {sim.uuid(1)}
        step = yp.retry.step
        other = _holder(sim.device(0))  # someone opens the workload's GPU: the event waits to be read
        try:
            assert r.p.opens.inotify is not None and r.p.opens.inotify.pending(5.0)
            at = yp.retry.at
            r.p.yields.woke(at)
            assert yp.on_wake(at) is True
            assert r.p.observer.scan_paused  # the look gave way, owed at once, same step
            assert yp.retry.step == step and yp.retry.at <= at and yp.deadline() == yp.retry.at
            assert not r.p.supervisor.workloads[KEY].stopping
            _event(r)
            now = time.monotonic()
            r.p.yields.woke(now)
            assert yp.on_wake(now) is True
            assert r.p.supervisor.workloads[KEY].stopping  # the new open: its stop went out
            assert yp.retry is not None and yp.retry.uuids == {sim.uuid(1)} and yp.retry.step == step
            steps = 0
            while yp.retry is not None:  # the first open's looks go on, each later, to the last
                yp.on_wake(yp.retry.at)
                steps += 1
            assert steps == 6 - step
        finally:
            other.kill()
            other.wait()
    finally:
        for p in crowd:
            p.kill()
            p.wait()
