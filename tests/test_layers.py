"""The layers: the library (gpu_mon.api) stands alone, decisions are pure, outputs only listen."""

from __future__ import annotations

import copy
import json
import logging
import os
import pkgutil
import re
import shutil
import subprocess
import sys

from conftest import ROOT, UUIDS, SimHost, run_as_nobody
from test_policy import config, holder, snap

import gpu_mon.api
from gpu_mon.api.model import Exited, Running, TtyUser
from gpu_mon.engine.loop import Loop
from gpu_mon.policy import decide as policy
from gpu_mon.policy.decisions import PolicyState

FRONT = ("gpu_mon.engine", "gpu_mon.outputs", "gpu_mon.commands", "gpu_mon.cli", "gpu_mon.config")


def test_the_library_imports_nothing_of_the_daemon_the_cli_or_outputs():
    modules = [f"gpu_mon.api.{m.name}" for m in pkgutil.iter_modules(gpu_mon.api.__path__)]
    assert "gpu_mon.api.observe" in modules and "gpu_mon.api.nvml" in modules
    code = (
        "import json, logging, signal, sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        "hs = logging.getLogger().handlers + logging.getLogger('gpu_mon').handlers\n"
        "handlers = len([h for h in hs if not isinstance(h, logging.NullHandler)])\n"
        "term = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'handlers': handlers, 'sigterm': term}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    seen = json.loads(r.stdout)
    assert [m for m in seen["modules"] if m.startswith(FRONT)] == []
    assert seen["handlers"] == 0 and seen["sigterm"] is True


def test_a_plain_user_takes_a_look_through_the_library(public_dir):
    # No daemon, no root, no logging set-up: `nobody` reads the simulated GPUs and sees a holder.
    sim = SimHost(public_dir, 2)
    for path in (public_dir / "dev", sim.path, *(public_dir / "dev").iterdir()):
        os.chmod(path, 0o755)
    # The package where `nobody` can read it, whatever directory the checkout is in (/root is 0700).
    code_dir = public_dir / "code"
    shutil.copytree(ROOT / "gpu_mon", code_dir / "gpu_mon", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (code_dir, *code_dir.rglob("*")):
        os.chmod(path, 0o755)
    code = (
        "import sys\n"
        "from gpu_mon.api.observe import look\n"
        "from gpu_mon.api.sim import SimBackend\n"
        "snap = look(SimBackend(sys.argv[1], create_devices=False))\n"
        "f = open(snap.reading.gpus[0].device)\n"
        "print(len(snap.reading.gpus), snap.reading.error, bool(snap.denied))\n"
        "from gpu_mon import Sentinel, get_gpu_usage\n"  # seed 001's API, $GPU_MON_SIM as the backend
        "s = Sentinel(1, 0.5, 1, 0.1, kill_fn=lambda: print('fired'))\n"
        "for u in (0.9, get_gpu_usage()): s.tick(u)\n"
    )
    # A root process that is not the looker's ancestor: on a machine where every other root process is
    # one (a CI runner with nothing but this test run), nothing would be unreadable to `nobody`.
    root_proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        r = run_as_nobody(
            ["/usr/bin/python3", "-c", code, str(sim.path)],
            {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code_dir), "GPU_MON_SIM": str(sim.path)},
            timeout=None,
        )
    finally:
        root_proc.kill()
        root_proc.wait()
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # a library prints nothing of its own
    # root's processes: unreadable to nobody, and said so; the idle GPUs (0%) fire the armed sentinel
    assert r.stdout.split() == ["2", "None", "True", "fired"]


def test_decide_is_pure():
    c = config()
    plan = policy.resolve(c, snap().reading.gpus)
    s = snap(
        now=200,
        holders=(holder(42),),
        running=(Running("m", 900, 50.0),),
        exited=(Exited("m", 1.0, 2.0, 1, False),),
        ttys=(TtyUser("/dev/pts/1", "bob", 1001, 3.0),),
    )
    state = PolicyState(free_since={UUIDS[0]: 1.0}, first_seen={(7, 1, UUIDS[0]): 5.0}, backoff={})
    before = (copy.deepcopy(s), copy.deepcopy(state))
    first = policy.decide(c, plan, s, state)
    assert (s, state) == before  # nothing it was given changed
    assert policy.decide(c, plan, s, state) == first  # and the same inputs give the same answer


class Recorder:
    def __init__(self):
        self.rounds = []

    def on_round(self, report):
        self.rounds.append(report)

    def on_event(self, event):
        pass

    def deadline(self):
        return None


class Broken(Recorder):
    def on_round(self, report):
        raise RuntimeError("disk full")


def test_a_broken_listener_is_skipped_and_logged_once(caplog):
    loop = Loop()
    good = Recorder()
    loop.listeners.extend([Broken(), good])
    with caplog.at_level(logging.ERROR, logger="gpu_mon"):
        for i in range(3):
            loop.publish(i)  # type: ignore[arg-type]
    loop.close()
    assert good.rounds == [0, 1, 2]
    assert [r.getMessage() for r in caplog.records] == [
        "Broken.on_round failed (shown once; the daemon goes on)"
    ]


def test_the_leader_stays_light():
    # The leader starts every workload: it must not drag in the daemon, the config or the outputs.
    code = "import sys, gpu_mon.engine.workloads.leader; print(' '.join(sorted(sys.modules)))"
    r = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}"],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = r.stdout.split()
    allowed = ("gpu_mon.engine", "gpu_mon.engine.workloads")  # the (empty) packages on the way
    heavy = [m for m in loaded if m.startswith(FRONT) and m not in allowed]
    assert heavy == [
        "gpu_mon.engine.workloads.cgroups",
        "gpu_mon.engine.workloads.ends",
        "gpu_mon.engine.workloads.leader",
        "gpu_mon.engine.workloads.linux",
    ]


OUTSIDE = {  # an outside library -> the one module that imports it
    "pynvml": "gpu_mon/api/nvml.py",
    "sqlite3": "gpu_mon/api/historydb.py",
    "matplotlib": "gpu_mon/commands/plot.py",
    "torch": "gpu_mon/stress/torchdev.py",
    "sdnotify": "gpu_mon/outputs/notify.py",
    "prometheus_client": "gpu_mon/outputs/exposition.py",
}


def test_each_outside_library_lives_behind_one_module():
    found: dict = {}
    for path in sorted((ROOT / "gpu_mon").rglob("*.py")):
        text = path.read_text()
        for lib in OUTSIDE:
            if re.search(rf"^\s*(import {lib}\b|from {lib}[. ])", text, re.M):
                found.setdefault(lib, set()).add(str(path.relative_to(ROOT)))
    assert found == {lib: {module} for lib, module in OUTSIDE.items()}
