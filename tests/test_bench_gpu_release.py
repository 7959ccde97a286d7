"""bench/gpu_release.py: its plan runs anywhere (no GPU, torch or NVML); the matrix itself needs a GPU.

A module that is "not installed" is a stand-in on PYTHONPATH whose import fails.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest
from conftest import run_script

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "gpu_release.py"


def run_bench(
    tmp_path: Path, *args: str, hide: Sequence[str] = ("torch", "pynvml")
) -> subprocess.CompletedProcess:
    return run_script(BENCH, *args, cwd=tmp_path, hide=hide)


def test_plan_lists_every_strategy_and_cell_without_a_gpu(tmp_path):
    r = run_bench(tmp_path, "--plan")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    out = r.stdout
    assert out.startswith("bench/gpu_release.py: 6 strategies x 2 newcomers = 12 cells, up to 5 rounds")
    assert "within 300 s" in out.splitlines()[0]
    for hold in ("chunks", "blocks", "one"):
        for release in ("free-then-exit", "exit"):
            assert f"--hold {hold} --release {release}" in out
    assert "--hold one --release free-then-exit (the default)" in out
    assert out.count("(the default)") == 1
    cells = [
        line for line in out.splitlines() if line.lstrip().split(".")[0].isdigit() and "newcomer" in line
    ]
    assert len(cells) == 12
    assert cells[0].split()[1:3] == ["newcomer", "torch"] and cells[-1].split()[1:3] == [
        "newcomer",
        "libcuda",
    ]
    assert "takes 90% of the GPU's total at once" in out


def test_quick_plan_keeps_to_three_minutes_and_the_asked_cells(tmp_path):
    r = run_bench(tmp_path, "--plan", "--quick", "--holds", "one", "--newcomers", "libcuda")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first == (
        "bench/gpu_release.py --quick: 2 strategies x 1 newcomers = 2 cells, up to 3 rounds "
        "(one trial of every cell each), within 180 s"
    )


def test_an_unknown_strategy_is_a_usage_error(tmp_path):
    r = run_bench(tmp_path, "--plan", "--holds", "one,lots")
    assert r.returncode == 2
    assert "--holds 'one,lots': expected a comma list of chunks, blocks, one" in r.stderr


def test_without_nvml_it_measures_nothing_and_says_so(tmp_path):
    r = run_bench(tmp_path, "--quick")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith("no NVIDIA GPU: ImportError: pynvml is not installed here; nothing measured")


def test_the_table_says_whether_memory_came_back_before_the_newcomer_was_ready():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_release
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def trial(freed: float, ready: float, ok: bool = True) -> dict:
        return {"freed_ms": freed, "ready_ms": ready, "alloc_ms": ready + 5, "exit_ms": 100.0, "ok": ok}

    results = {
        ("torch", "one", "exit"): [trial(80, 250), trial(90, 260)],
        ("torch", "chunks", "free-then-exit"): [trial(900, 250, ok=False), trial(math.nan, 250)],
    }
    lines = gpu_release.summary(results).splitlines()
    fast = next(line for line in lines if " one " in line).split()
    slow = next(line for line in lines if " chunks " in line).split()
    assert fast[-1] == "yes" and fast[4] == "0/2"
    assert slow[-1] == "no" and slow[4] == "1/2"


# torch as the newcomer sees it on a GPU of 4 GiB with 3 GiB free: enough to run its script without one.
TORCH_STUB = """
class OutOfMemoryError(RuntimeError):
    pass
uint8 = "uint8"
class cuda:
    init = staticmethod(lambda: None)
    synchronize = staticmethod(lambda: None)
    mem_get_info = staticmethod(lambda: (3 << 30, 4 << 30))
def empty(n, dtype, device):
    if n > 3 << 30:
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 3.60 GiB\\nmore")
    return n
"""


@pytest.mark.parametrize("go, share", [(True, 0.5), (False, 0.5), (True, 0.9), (False, 0.9)])
def test_the_newcomer_waits_for_its_go_only_when_asked_and_takes_its_share_once(tmp_path, go, share):
    (tmp_path / "torch.py").write_text(TORCH_STUB)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import newcomer
    finally:
        sys.path.remove(str(ROOT / "bench"))
    sent = time.monotonic_ns()
    proc = newcomer.start("torch", share, env=dict(os.environ, PYTHONPATH=str(tmp_path)), go=go)
    try:
        if go:  # gpu_release's: it loads, says so and waits; its clock starts at the go
            assert proc.stdout.readline() == "loaded\n"
            sent = time.monotonic_ns()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        else:  # gpu_preempt's foreign process: no go to wait for
            assert proc.stdin is None
        out = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert sent <= out["t_init"] <= out["t_ready"] <= out["t_alloc"]
    assert out["free_at_ready_mib"] == 3072
    assert (out["ok"], out["err"]) == (
        (True, "") if share == 0.5 else (False, "CUDA out of memory. Tried to allocate 3.60 GiB")
    )


def _gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu(), reason="needs an NVIDIA GPU")
def test_one_cell_runs_on_a_gpu(tmp_path):
    args = (
        "--rounds",
        "1",
        "--holds",
        "one",
        "--releases",
        "exit",
        "--newcomers",
        "libcuda",
        "--memory",
        "40%",
    )
    r = run_bench(tmp_path, *args, hide=())
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("libcuda"))
    assert row.split()[3] == "1"  # one trial


def test_the_default_it_marks_is_the_stressors_own():
    """--plan's "(the default)" is what `gpu-mon stress` does without --hold and --release."""
    import argparse

    from gpu_mon.commands import stress

    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args([])
    r = subprocess.run([sys.executable, str(BENCH), "--plan"], capture_output=True, text=True, check=True)
    marked = next(line for line in r.stdout.splitlines() if "(the default)" in line)
    assert f"--hold {args.hold} --release {args.release} (the default)" in marked
