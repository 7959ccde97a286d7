"""A test run that is stopped leaves nothing running.

A test run stopped by SIGTERM (a CI timeout, `systemctl stop`, `timeout`), SIGINT or SIGHUP (its terminal
closed) tears its fixtures down as after a Ctrl-C, so a test daemon stops its workloads; a run that is
SIGKILLed takes its daemons with it (they stop their workloads). Each case runs pytest in a subprocess on a
small test of its own that starts a real daemon with a workload, and stops that pytest while the test runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import psutil
import pytest
from conftest import ROOT, wait_for

from gpu_mon.engine.workloads import cgroups

# Runs in the inner pytest, with the suite's conftest as a plugin (`-p conftest`). Each test tells the outer
# one what it started (a JSON file, written whole) and waits to be stopped.
INNER = """
import json
import os
import time

import psutil
from conftest import read_reports, wait_for, workload_cmd
from test_queue import JOB, made_lab, queue_body


def _tell(pids, users=(), dirs=()):
    path = os.environ["INNER_PIDS"]
    with open(path + ".tmp", "w") as f:
        json.dump({"pids": pids, "users": list(users), "dirs": list(dirs)}, f)
    os.replace(path + ".tmp", path)
    time.sleep(600)  # until the outer test stops this run


def test_a_daemon_with_a_workload(tmp_path, daemon_factory):
    report = tmp_path / "report.jsonl"
    cmd = workload_cmd(tmp_path, "--report", str(report), "--children", "1")
    body = f"[gpu-all]\\ngpus = ALL\\n\\n[process-miner]\\ncmd = {cmd}\\ngpus = 0\\nuser = root\\n"
    d = daemon_factory(body)
    command = d.wait_running("miner")
    children = wait_for(
        lambda: [e["pid"] for e in read_reports(report) if e["event"] == "child"], what="the workload's child"
    )
    leader = d.workload("miner")["pid"]
    _tell({"daemon": d.proc.pid, "leader": leader, "workload": command, "child": children[0]})


def test_a_queue_job(daemon_factory):
    with made_lab("gmsc", ("gmscalice", "gmscbob"), JOB) as lab:
        d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
        wait_for(lab.socket.exists, 20, "the queue's socket")
        job_id = lab.submit(lab.alice, *lab.job_cmd("run"))
        lab.wait_running(lab.alice, job_id)
        below = {f"{p.name()} {p.pid}": p.pid for p in psutil.Process(d.proc.pid).children(recursive=True)}
        _tell({"daemon": d.proc.pid, **below}, (lab.alice.name, lab.bob.name), (str(lab.dir),))
"""


def _reset_stop_signals() -> None:
    """In the inner pytest, before its exec: the stop signals as a terminal's process has them (an outer run
    started in the background by a shell without job control inherits SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _inner_pytest(base: Path, test: str) -> subprocess.Popen:
    """pytest on one test of INNER in `base`, with the suite's conftest and its own temporary directory."""
    (base / "test_inner.py").write_text(INNER)
    (base / "tmp").mkdir()
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT)])
    env = dict(os.environ, INNER_PIDS=str(base / "started.json"), PYTHONPATH=path)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider"]
    argv += ["--rootdir", str(base), "--basetemp", str(base / "tmp"), f"{base / 'test_inner.py'}::{test}"]
    with open(base / "inner.log", "wb") as out:
        return subprocess.Popen(
            argv,
            cwd=base,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_reset_stop_signals,
        )


class Started:
    """What the inner test started, read while it runs (a pid is not mistaken for a later process of the
    same number): its processes by name, the users and directories it made."""

    def __init__(self, base: Path):
        path = base / "started.json"
        text = wait_for(lambda: path.exists() and path.read_text(), 60, "the inner test's daemon and work")
        told = json.loads(str(text))
        self.procs = {name: psutil.Process(pid) for name, pid in told["pids"].items()}
        self.users: List[str] = told["users"]
        self.dirs: List[str] = told["dirs"]
        self.uids = [pwd.getpwnam(name).pw_uid for name in self.users]

    def running(self) -> List[str]:
        """The processes still running, and any of the users it made."""
        out = []
        for name, p in self.procs.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{name} {p.pid}")
        for p in psutil.process_iter(["uids", "pid"]):
            if p.info["uids"] and p.info["uids"].real in self.uids:
                out.append(f"uid {p.info['uids'].real}'s {p.info['pid']}")
        return out

    def left(self) -> List[str]:
        """The users, directories and workload groups (cgroup v2) still there."""
        users = [f"user {name}" for name in self.users if _user_exists(name)]
        return users + [f"directory {d}" for d in self.dirs if os.path.exists(d)] + self.groups()

    def groups(self) -> List[str]:
        parent, _ = cgroups.own_group_dir()
        if parent is None or not os.path.isdir(parent) or "daemon" not in self.procs:
            return []
        prefix = f"{cgroups.PREFIX}{self.procs['daemon'].pid}."
        return [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(prefix)]

    def clean_up(self) -> None:
        """Whatever the outcome: the daemon stopped as an admin would (it stops its work), then what is left
        of what the inner test started killed and removed."""
        with contextlib.suppress(psutil.Error):
            if self.procs["daemon"].is_running():
                self.procs["daemon"].terminate()
                self.procs["daemon"].wait(20)
        for p in self.procs.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
        for name in self.users:  # as made_lab does: only the test's own users
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
            subprocess.run(["userdel", "-r", name], capture_output=True)
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        for group in self.groups():
            with contextlib.suppress(OSError):
                os.rmdir(group)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _stop_and_check(tmp_path: Path, test: str, sig: signal.Signals) -> None:
    """Start the inner test, stop its pytest with `sig` once its work runs; nothing of it may be left."""
    inner = _inner_pytest(tmp_path, test)
    started: Optional[Started] = None
    try:
        started = Started(tmp_path)
        assert all(p.is_running() for p in started.procs.values()), "the inner test's processes run"
        inner.send_signal(sig)
        wait_for(lambda: inner.poll() is not None, 60, f"the inner pytest to exit on {sig.name}")
        try:
            wait_for(lambda: not started.running(), 20, "the inner test's processes to end")
        except AssertionError:
            raise AssertionError(f"left running after {sig.name}: {', '.join(started.running())}") from None
        assert not started.left(), f"left after {sig.name}: {', '.join(started.left())}"
        if sig != signal.SIGKILL:  # pytest's own end for an interrupted run, after its teardown
            assert inner.returncode == pytest.ExitCode.INTERRUPTED, (tmp_path / "inner.log").read_text()
    finally:
        if inner.poll() is None:
            inner.kill()
        inner.wait(10)
        if started is not None:
            started.clean_up()


STOPS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL]


@pytest.mark.parametrize("sig", STOPS, ids=[s.name for s in STOPS])
def test_a_stopped_test_run_leaves_no_daemon_leader_or_workload_running(tmp_path, sig):
    _stop_and_check(tmp_path, "test_a_daemon_with_a_workload", sig)


@pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")
def test_a_run_stopped_by_sigterm_leaves_no_queue_job_test_user_or_directory(tmp_path):
    _stop_and_check(tmp_path, "test_a_queue_job", signal.SIGTERM)


def test_every_daemon_a_test_starts_itself_dies_with_the_run():
    """A `gpu-mon run` started by a test's own Popen (not daemon_factory) asks for the death signal too:
    else a SIGKILLed run leaves it, and its workloads, running."""
    import ast

    missing = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("subprocess.Popen")):
                continue
            argv = ast.unparse(node.args[0]) if node.args else ""
            told = "preexec_fn" in {k.arg for k in node.keywords}
            if "GPU_MON" in argv and argv.endswith("'run']") and not told:
                missing.append(f"{path.name}:{node.lineno}")
    assert missing == []
