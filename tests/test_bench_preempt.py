"""bench/preempt.py checks what it needs before it starts anything, and says what is missing in one line.

Only the checks are exercised here (the benchmark itself is timing, which belongs in bench/). A module that
is "not installed" is a stand-in on PYTHONPATH whose import fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import run_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "preempt.py"
# Small enough that, without the checks, the benchmark would run (and fail late) within the timeout.
QUICK = ["--procs", "0", "--trials", "1", "--idle-seconds", "0.1"]


def run_bench(tmp_path: Path, *args: str, hide: List[str] = ()) -> subprocess.CompletedProcess:
    return run_script(BENCH, *QUICK, *args, cwd=tmp_path, hide=hide)


def test_missing_metrics_extra_is_one_line_before_anything_starts(tmp_path):
    r = run_bench(tmp_path, "--baseline", "", hide=["prometheus_client"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""  # nothing started: no background processes, no daemon
    assert r.stderr.startswith("preempt.py: cannot start: ") and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.rstrip("\n").endswith(
        "needs the Python module prometheus_client (pip install '.[metrics]')"
    ), r.stderr


def test_every_missing_thing_is_named_in_the_same_line(tmp_path):
    r = run_bench(tmp_path, "--baseline", "no-such-ref", hide=["prometheus_client", "sdnotify"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1, r.stderr
    assert "needs the Python module sdnotify (pip install sdnotify)" in r.stderr
    assert "needs the Python module prometheus_client" in r.stderr
    assert "--baseline no-such-ref is not a commit of this checkout" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("bad", [["--trials", "0"], ["--array", "-1"]])
def test_bad_numbers_are_a_usage_error(tmp_path, bad):
    r = run_bench(tmp_path, *bad, "--baseline", "")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.splitlines()[-1].endswith(
        "--trials must be at least 1, --procs, --jobs and --array at least 0, --idle-seconds more than 0"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the benchmark runs daemons that must see every process")
def test_an_array_queued_row_beside_the_row_without_it(tmp_path):
    r = run_bench(tmp_path, "--baseline", "", "--array", "200")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {
        c[0]: c for c in (re.split(r"\s{2,}", line.strip()) for line in r.stdout.splitlines()) if len(c) == 8
    }
    array = "the same with one 200-element array queued (on the busy GPU)"
    shipped = next(k for k in rows if k.startswith("gpu-mon as shipped"))
    assert array in rows, r.stdout
    for label in (shipped, array):
        trials, term_p50, *_, cpu = rows[label][1:]
        assert trials == "1" and float(term_p50) > 0 and float(cpu) >= 0, rows[label]


# ----- bench/gpu_preempt.py without a GPU: its options and the daemon it would run

GPU_PREEMPT = ROOT / "bench" / "gpu_preempt.py"


def gpu_preempt_module():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_preempt

    return gpu_preempt


@pytest.mark.parametrize("value", ["150%", "0%", "90", "lots", "-5%"])
def test_gpu_preempt_foreign_alloc_must_be_a_share_of_the_gpu(value):
    r = subprocess.run(
        [sys.executable, str(GPU_PREEMPT), f"--foreign-alloc={value}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.splitlines()[-1].endswith(
        f"argument --foreign-alloc: {value!r}: expected a percent of the GPU's total, such as 90%"
    ), r.stderr


def test_gpu_preempt_greedy_newcomer_and_the_stressors_own_hold(tmp_path):
    gp = gpu_preempt_module()
    assert gp.share("90%") == 0.9 and gp.share("100%") == 1.0
    assert gp.held_fraction("88%") == 0.88 and gp.held_fraction("default") is None
    own = gp.daemon_config(tmp_path, "default")
    assert " -m gpu_mon stress --report-seconds 30\n" in own and "--memory" not in own
    assert " -m gpu_mon stress --memory 88% --report-seconds 30\n" in gp.daemon_config(tmp_path, "88%")
    for kind in ("torch", "libcuda"):  # the share comes from the command line, no retry
        script = gp.newcomer.script(kind, go=False)
        assert "share = float(sys.argv[1])" in script and "total // 2" not in script
        assert "readline" not in script and "loaded" not in script  # its clock starts once it has loaded


def test_gpu_preempt_ignores_a_hosts_monitor_only_when_told(tmp_path, monkeypatch):
    """--ignore-programs (or gpu_proof.py's, through the environment) adds to the bench's own reader."""
    gp = gpu_preempt_module()
    assert "ignore_programs = gpu-bench-nvml\n" in gp.daemon_config(tmp_path, "88%")
    told = gp.daemon_config(tmp_path, "88%", " ld-linux-x86-64.so.2, nvtop")
    assert "ignore_programs = gpu-bench-nvml,ld-linux-x86-64.so.2,nvtop\n" in told
    monkeypatch.setattr(sys, "argv", ["gpu_preempt.py"])
    assert gp.parse_args().ignore_programs == ""
    monkeypatch.setenv(gp.IGNORE_ENV, "nvtop")
    assert gp.parse_args().ignore_programs == "nvtop"
    monkeypatch.setattr(sys, "argv", ["gpu_preempt.py", "--ignore-programs", "x"])
    assert gp.parse_args().ignore_programs == "x"


def test_gpu_preempt_summary_leaves_disturbed_trials_out():
    gp = gpu_preempt_module()
    trial = {"ok": True, "freed_ms": 200.0, "off_list_ms": 300.0, "ready_ms": 250.0}
    disturbed = {**trial, "ok": False, "freed_ms": -469.0, "disturbed": "stopped for a monitor"}
    (row,) = gp.summary_rows([trial, disturbed])
    assert row == [1, 1, 0, "200", "200", "300", "300", "250"]
    assert gp.summary_rows([disturbed]) == []
