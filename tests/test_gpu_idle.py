"""On a real NVIDIA GPU only (marked `gpu`, skipped elsewhere): per-process utilization of a torch job as
NVML reports it to gpu-mon, and `gpu-mon watch` stopping an idle torch job (and never a busy one). Needs torch
with CUDA. bench/gpu_proof.py runs the watch tests (check watch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import gpujobs
import pytest
from conftest import GPU_MON

from gpu_mon.api.nvml import NvmlBackend

BUSY = (
    "import torch, time\n"
    "a = torch.randn(4096, 4096, device='cuda')\n"
    "print('ready', flush=True)\n"
    "while True:\n    a @ a\n"
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


def _watch(job_script: str, *options: str) -> tuple[subprocess.Popen, str]:
    """`gpu-mon watch OPTIONS -- python -c JOB` on GPU 0 (by UUID), in its own session; and a marker that
    is in the job's command line."""
    with gpujobs.nvml() as reader:
        env = gpujobs.on_gpu(reader.uuid)
    marker = f"gpu-test-watch-{os.getpid()}-{time.monotonic_ns()}"
    argv = [*GPU_MON, "watch", *options, "--", sys.executable, "-c", f"# {marker}\n{job_script}"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    return proc, marker


def _end(proc: subprocess.Popen, marker: str) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in gpujobs.alive_with(marker):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.gpu
def test_watch_stops_an_idle_torch_job(record_property):
    """The window is 10 delay samples (torch starts meanwhile) and 5 idle ones, a second apart: 15 s."""
    sample_s, delay, samples = 1, 10, 5
    window = (delay + samples) * sample_s
    t0 = time.monotonic()
    proc, marker = _watch(gpujobs.IDLE, "-s", str(sample_s), "-n", str(samples), "-d", str(delay), "-x")
    try:
        _, err = proc.communicate(timeout=window + 60)
        took = time.monotonic() - t0
        left = gpujobs.alive_with(marker)
        record_property("idle_exit", proc.returncode)
        record_property("idle_took_s", round(took, 2))
        record_property("window_s", window)
        record_property("sample_s", sample_s)
        record_property("idle_left", len(left))
        assert proc.returncode == 124, err
        assert "idle (" in err, err
        assert not left, f"still running after watch: {left}"
        # within one sample of the window's end, plus the interpreter's start-up
        assert window - sample_s <= took <= window + sample_s + 2, (took, err)
    finally:
        _end(proc, marker)


@pytest.mark.gpu
def test_watch_never_stops_a_busy_torch_job(record_property):
    """20 delay samples a second apart (torch starts meanwhile: until it holds the GPU, the tree is idle),
    then a window of 3 samples; once the job computes, watched for 20 s (quick: 10)."""
    observe = gpujobs.repeats(10, 20)
    proc, marker = _watch(gpujobs.BUSY, "-s", "1", "-n", "3", "-d", "20")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=observe)  # the claim itself: it must still run after `observe` seconds
        ran = time.monotonic() - start
        record_property("busy_ran_s", round(ran, 1))
        record_property("busy_stopped", int(proc.returncode is not None))
        assert proc.returncode is None, f"watch ended (exit {proc.returncode}) after {ran:.1f} s"
        proc.send_signal(signal.SIGTERM)  # forwarded to the job
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 124, err
        assert not gpujobs.alive_with(marker)
    finally:
        _end(proc, marker)
