"""On a real NVIDIA GPU only (marked `gpu`): the per-process utilization gpu-mon reads for a busy torch job
against `nvidia-smi pmon` over the same seconds. Run by bench/gpu_proof.py (check utilization)."""

from __future__ import annotations

import statistics
import subprocess
import time
from typing import List, Optional

import pytest
from gpujobs import BUSY, Job, nvml, on_gpu, repeats

from gpu_mon.api.nvml import NvmlBackend


def pmon_sm(output: str, pid: int) -> List[float]:
    """The job's SM % from `nvidia-smi pmon -s u` lines (`gpu pid type sm mem ...`); '-' left out."""
    values = []
    for line in output.splitlines():
        fields = line.split()
        ours = len(fields) > 3 and not line.lstrip().startswith("#") and fields[1] == str(pid)
        if ours and fields[3].replace(".", "", 1).isdigit():
            values.append(float(fields[3]))
    return values


def sample(backend: NvmlBackend, pid: int) -> Optional[int]:
    gpu = backend.read().gpus[0]
    return next((p.utilization_pct for p in gpu.processes or () if p.pid == pid), None)


@pytest.mark.gpu
def test_per_process_utilization_agrees_with_nvidia_smi_pmon(record_property):
    seconds = repeats(15, 30)
    with nvml() as reader:
        gpu_uuid = reader.uuid
    with Job(BUSY, on_gpu(gpu_uuid)) as job:
        job.ready()
        pmon = subprocess.Popen(
            ["nvidia-smi", "pmon", "-i", "0", "-s", "u", "-d", "1", "-c", str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        backend = NvmlBackend()
        ours: List[Optional[int]] = []
        try:
            sample(backend, job.pid)  # the first reading starts NVML's sampling period
            tick = time.monotonic()
            for _ in range(seconds):  # one reading a second, as pmon's
                tick += 1
                time.sleep(max(0.0, tick - time.monotonic()))
                ours.append(sample(backend, job.pid))
            output, _ = pmon.communicate(timeout=30)
        finally:
            backend.close()
            if pmon.poll() is None:
                pmon.kill()
                pmon.wait()
    theirs = pmon_sm(output, job.pid)
    known = [float(u) for u in ours if u is not None]
    pairs = list(zip(known, theirs))
    assert pairs, f"no pairs: gpu-mon {ours}, pmon {theirs}"
    mad = statistics.mean(abs(a - b) for a, b in pairs)
    record_property("samples", len(pairs))
    record_property("mean_abs_diff_pct", round(mad, 2))
    record_property("gpu_mon_mean_pct", round(statistics.mean(known), 1))
    record_property("pmon_mean_pct", round(statistics.mean(theirs), 1))
    assert len(known) == len(ours), f"gpu-mon had no per-process utilization in some readings: {ours}"
    assert mad <= 10, (ours, theirs)
    assert statistics.mean(known) >= 50, ours
