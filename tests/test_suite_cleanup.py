"""A test run that is stopped (SIGTERM: a CI job cancelled; SIGKILL) leaves no test daemon, leader or
workload running (issue 38 item 9): conftest.py turns SIGTERM into Ctrl-C, so the fixtures tear down, and a
test daemon gets SIGTERM when the run that started it dies (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import wait_for

TESTS = Path(__file__).resolve().parent

INNER = """
    import os
    import time
    from pathlib import Path

    def test_runs_until_stopped(daemon_factory, tmp_path):
        mark = Path(os.environ["MARK"])
        script = tmp_path / "work.sh"
        script.write_text(f"#!/bin/sh\\necho $$ > {mark}.tmp\\nmv {mark}.tmp {mark}\\nexec sleep 600\\n")
        script.chmod(0o755)
        body = f"[gpu-all]\\ngpus = ALL\\n[process-w]\\ncmd = {script}\\ngpus = 0\\nuser = root\\n"
        d = daemon_factory(body, defaults={"start_delay_seconds": 0})
        Path(f"{mark}.daemon").write_text(str(d.proc.pid))
        time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_test_run_leaves_no_daemon_leader_or_workload(tmp_path: Path, sig: int):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_inner.py").write_text(textwrap.dedent(INNER))
    mark = tmp_path / "workload.pid"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    )
    env.update(MARK=str(mark))
    env.pop("PYTEST_ADDOPTS", None)
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", str(suite)],
        cwd=suite,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: mark.exists() and Path(f"{mark}.daemon").exists(), 60, "the inner test's workload")
        workload, daemon = int(mark.read_text()), int(Path(f"{mark}.daemon").read_text())
        assert _alive(workload) and _alive(daemon)
        leaders = _children(daemon)
        assert leaders, "the workload's leader"
        inner.send_signal(sig)
        inner.wait(60)
        left = lambda: [p for p in (daemon, workload, *leaders) if _alive(p)]  # noqa: E731
        wait_for(lambda: not left(), 30, "the daemon, its leader and the workload gone")
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        _stop_left(mark)  # (a failing run leaves the machine as it found it all the same)
    assert inner.returncode != 0


def _stop_left(mark: Path) -> None:
    """Whatever the inner run left: its daemon stopped as an admin would, then every process killed."""
    pids = [int(p.read_text()) for p in (Path(f"{mark}.daemon"), mark) if p.exists()]
    for pid in pids[:1]:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda pid=pid: not _alive(pid), 30, "the inner run's daemon stopped")
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []
