"""bench/queue.py runs (a tiny queue, no baseline) and prints its table; with bench/ on a process's
sys.path, `import queue` is still the standard library's.

Only that it runs and what it prints: its timings belong to the benchmark itself."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "queue.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="the benchmark's daemon runs jobs: needs root")
def test_bench_queue_runs_as_a_script_and_prints_every_row(tmp_path):
    quick = ["--jobs", "20", "--baseline", "", "--trials", "1", "--hostile", "20", "--start-delay", "0.1"]
    quick += ["--arrays", "50", "--idle-seconds", "1"]
    # Its jobs run as root: their daemon makes root's default output directory (a fresh machine has none);
    # what it made that was not there before is removed afterwards.
    made = _first_missing(Path(pwd.getpwuid(os.geteuid()).pw_dir), ".local/state/gpu-mon/jobs")
    try:
        r = run_script(BENCH, *quick, cwd=tmp_path)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "CPUs; kernel" in lines[0] and lines[1].split() == ["this", "checkout"]
    labels = [
        "gpu-mon submit --hold -- true, the whole command: p50 / p99",
        "submit -> id p50 / p99, 0-200 queued",
        "submit -> id p50 / p99, 20 queued",
        "gpu-mon jobs (table), 20 queued: median / max",
        "gpu-mon jobs --json, 20 queued: median / max",
        "job start after its GPU frees, less the start delay: median / max",
        "daemon CPU to take 20 submits",
        "daemon idle CPU, 20 queued",
        "submit p99 without / with 20 hostile connections",
        "submit --hold --array 0-49 -> id: p50 / max of 5",
        "daemon memory (VmRSS): empty -> 5 such arrays held",
        "gpu-mon jobs, 5 such arrays held: median / max",
        "20 single submits (a shell loop), in all",
    ]
    assert [line[: len(label)] for line, label in zip(lines[3:], labels)] == labels
    ends = ("ms", "rounds)", " s", "MB", "of a core")
    assert all(line.rstrip().endswith(ends) for line in lines[3:]) and len(lines) == 16


def _first_missing(home: Path, below: str):
    """The first directory of home/below that does not exist yet (None: all of it does)."""
    path = home
    for part in Path(below).parts:
        path = path / part
        if not path.exists():
            return path
    return None


def test_bench_on_sys_path_does_not_hide_the_standard_librarys_queue(tmp_path):
    code = "import queue, concurrent.futures; print(queue.Queue.__module__, queue.__file__)"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "bench"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    name, path = r.stdout.split()
    assert name == "queue" and Path(path).parent != ROOT / "bench"
