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
    # The leader starts every workload (a job's start waits for it): it must not drag in the daemon, the
    # config or the outputs, nor the standard library's heavy modules, and it starts without site (-S).
    code = "import sys, gpu_mon.engine.workloads.leader; print(' '.join(sorted(sys.modules)))"
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); {code}"],
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
        "gpu_mon.engine.workloads.unguarded",  # (the guard it arms as the daemon dies: subprocess only)
    ]
    assert [m for m in ("logging", "dataclasses", "inspect", "ast", "site") if m in loaded] == []


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


# ------------------------------------------------------------------------------------------------------
# The import graph, read from the source (imports inside functions and under TYPE_CHECKING count too).

PACKAGE = ROOT / "gpu_mon"
# Bottom to top: a unit (a top-level package or module of gpu_mon) imports only units below it.
LAYERS = (
    ("gpu_mon.safefile", "gpu_mon.shellwords", "gpu_mon.quickclient"),
    ("gpu_mon.config",),
    ("gpu_mon.api",),
    ("gpu_mon",),  # the package itself: the library's public names (Sentinel, get_gpu_usage) and version
    ("gpu_mon.policy",),
    ("gpu_mon.engine",),
    ("gpu_mon.slurm", "gpu_mon.queue"),
    ("gpu_mon.outputs",),
    ("gpu_mon.stress", "gpu_mon.reference"),
    ("gpu_mon.commands",),
    ("gpu_mon.cli",),
    ("gpu_mon.jobids",),
    ("gpu_mon.entry",),  # the executable: _job-ids and a quick submit before the CLI
    ("gpu_mon.__main__", "gpu_mon.docs_gen"),
)


def _modules() -> dict:
    """{module name: path} of every module in the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path, modules: dict) -> set:
    """The package's modules that `name` imports anywhere in its source (`from pkg import submodule`
    counts as the submodule alone)."""
    import ast

    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            subs = [f"{prefix}.{a.name}" for a in node.names if f"{prefix}.{a.name}" in modules]
            targets = subs if len(subs) == len(node.names) else [prefix, *subs]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("gpu_mon") and t != name:
                out.add(t)
    return out


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one node (Tarjan's, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_circle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_circle_between_top_level_packages_and_each_imports_only_layers_below():
    graph = _graph()
    units = {}
    for module, targets in graph.items():
        units.setdefault(_unit(module), set()).update(_unit(t) for t in targets if _unit(t) != _unit(module))
    assert _cycles(units) == []
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    assert sorted(units) == sorted(rank), "a top-level package or module is missing from LAYERS"
    upward = sorted(
        f"{m} imports {t}"
        for m, targets in graph.items()
        for t in targets
        if _unit(t) != _unit(m) and rank[_unit(t)] >= rank[_unit(m)]
    )
    assert upward == []


def test_the_policy_never_imports_the_io_core():
    graph = _graph()
    policy = {
        m: sorted(t for t in ts if _unit(t) not in ("gpu_mon.api", "gpu_mon.config", "gpu_mon.policy"))
        for m, ts in graph.items()
        if _unit(m) == "gpu_mon.policy"
    }
    assert "gpu_mon.policy.decide" in policy
    assert {m: ts for m, ts in policy.items() if ts} == {}


def test_the_import_graph_reader_sees_an_import_inside_a_function(tmp_path):
    # (the checks above are only as good as this reader)
    pkg = tmp_path / "gpu_mon"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from gpu_mon.b import y\n")
    (pkg / "b.py").write_text("from .a import x\n")
    modules = {
        "gpu_mon": pkg / "__init__.py",
        "gpu_mon.a": pkg / "a" / "__init__.py",
        "gpu_mon.a.x": pkg / "a" / "x.py",
        "gpu_mon.b": pkg / "b.py",
    }
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    assert graph["gpu_mon.a.x"] == {"gpu_mon.b"} and graph["gpu_mon.b"] == {"gpu_mon.a.x"}
    assert _cycles(graph) == [["gpu_mon.a.x", "gpu_mon.b"]]
