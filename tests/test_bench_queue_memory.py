"""bench/queue_memory.py runs (a tiny load, no baseline) and prints its table.

Only that it runs and what it prints: its figures belong to the benchmark itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_script

BENCH = Path(__file__).resolve().parent.parent / "bench" / "queue_memory.py"


@pytest.mark.skipif(
    os.geteuid() != 0, reason="the benchmark's daemon runs as root, its hostile user as nobody"
)
def test_bench_queue_memory_runs_and_prints_every_row(tmp_path):
    quick = [
        "--jobs",
        "5",
        "--stalled",
        "2",
        "--churn",
        "2",
        "--half",
        "2",
        "--seconds",
        "2",
        "--baseline",
        "",
    ]
    r = run_script(BENCH, *quick, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "CPUs; kernel" in lines[0] and lines[1].split() == ["this", "checkout"]
    labels = [
        "daemon RSS, 5 big jobs queued, before the load",
        "daemon peak RSS (VmHWM) under 2 stalled + 2 churning + 2 half-sending clients, 2 s",
        "another user's submit under the load: p50 / max (answered)",
        "hostile `jobs` asks answered / refused in one line",
        "gpu-mon jobs --json (5 big jobs and the probes), after",
    ]
    assert [line[: len(label)] for line, label in zip(lines[3:], labels)] == labels and len(lines) == 8
    assert lines[7].rstrip().endswith(" s") and " MB" in lines[4]
