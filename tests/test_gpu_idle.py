"""On a real NVIDIA GPU only (marked `gpu`, skipped elsewhere): per-process utilization of a torch job as
NVML reports it to gpu-mon, and `gpu-mon watch` stopping an idle torch job. Needs torch with CUDA."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import GPU_MON, wait_for

from gpu_mon.api.nvml import NvmlBackend

BUSY = (
    "import torch, time\n"
    "a = torch.randn(4096, 4096, device='cuda')\n"
    "print('ready', flush=True)\n"
    "while True:\n    a @ a\n"
)
IDLE = (
    "import torch, time\n"
    "a = torch.randn(1024, 1024, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.mark.gpu
def test_per_process_utilization_of_a_busy_torch_job():
    job = subprocess.Popen(
        [sys.executable, "-c", BUSY],
        stdout=subprocess.PIPE,
        env={"CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin:/bin"},
    )
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == b"ready"
        backend = NvmlBackend()
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            gpu = backend.read().gpus[0]
            seen += [p.utilization_pct for p in gpu.processes or () if p.pid == job.pid]
            time.sleep(1)
        backend.close()
        known = [u for u in seen if u is not None]
        assert known, f"no per-process utilization for the job: {seen}"
        assert max(known) >= 50, seen
    finally:
        job.kill()
        job.wait()


@pytest.mark.gpu
def test_watch_stops_an_idle_torch_job():
    t0 = time.monotonic()
    r = subprocess.run(
        [*GPU_MON, "watch", "-s", "1", "-n", "5", "-d", "5", "-x", "--", sys.executable, "-c", IDLE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stderr
    assert took < 5 + 5 + 1 + 10 + 5, (took, r.stderr)  # window + a sample + torch start-up + grace
    wait_for(lambda: "stopped" in r.stderr, timeout=1, what="the stop line")
