"""The GPU host: is there an NVIDIA GPU, what it is, and which processes NVML shows on it.

NVML is read in a short-lived child process, never in the proof's own: a process that has initialised NVML
holds every /dev/nvidia* node open, and gpu-mon (rightly) counts such a holder as someone using the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import psutil

PROBE_TIMEOUT_S = 4.0  # the no-GPU answer must come within 5 s
TORCH_TIMEOUT_S = 90.0

PROBE = r"""
import json
def text(v):
    return v.decode() if isinstance(v, bytes) else str(v)
try:
    import pynvml
except ImportError:
    print(json.dumps({"error": "nvidia-ml-py (pynvml) is not installed"}))
    raise SystemExit(0)
try:
    pynvml.nvmlInit()
except Exception as exc:
    print(json.dumps({"error": f"NVML cannot start: {text(exc) or type(exc).__name__}"}))
    raise SystemExit(0)
try:
    gpus, procs = [], []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid, memory = text(pynvml.nvmlDeviceGetUUID(h)), pynvml.nvmlDeviceGetMemoryInfo(h)
        gpus.append({"index": i, "uuid": uuid, "name": text(pynvml.nvmlDeviceGetName(h)),
                     "memory_total_mib": memory.total >> 20, "memory_used_mib": memory.used >> 20})
        listed = list(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        listed += list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
        procs += [{"uuid": uuid, "pid": p.pid, "mib": (p.usedGpuMemory or 0) >> 20} for p in listed]
    cuda = pynvml.nvmlSystemGetCudaDriverVersion()
    doc = {"driver": text(pynvml.nvmlSystemGetDriverVersion()), "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
           "gpus": gpus, "processes": procs}
    if not gpus:
        doc["error"] = "NVML lists no GPU"
    print(json.dumps(doc))
except Exception as exc:
    print(json.dumps({"error": f"NVML: {text(exc) or type(exc).__name__}"}))
finally:
    pynvml.nvmlShutdown()
"""

TORCH = (
    "import warnings; warnings.simplefilter('ignore'); import torch; "
    "print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"
)


def probe(timeout: float = PROBE_TIMEOUT_S) -> Dict[str, Any]:
    """NVML's view: driver, CUDA, GPUs, processes; {"error": why} when there is no usable GPU."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"NVML did not answer within {timeout:g} s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": f"the NVML probe failed: {why}"}


def describe(nvml: Dict[str, Any]) -> Dict[str, Any]:
    """The header of the table: GPUs, driver, CUDA, torch, kernel."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", TORCH], capture_output=True, text=True, timeout=TORCH_TIMEOUT_S
        )
        version, cuda, usable = ([*done.stdout.split(), "?", "?", "?"])[:3]
        torch = f"{version} (CUDA {cuda}, usable: {usable})" if done.returncode == 0 else "not importable"
    except subprocess.TimeoutExpired:
        torch = f"did not import within {TORCH_TIMEOUT_S:g} s"
    return {
        "gpus": [
            f"{g['index']}: {g['name']} ({g['memory_total_mib']} MiB), {g['uuid']}" for g in nvml["gpus"]
        ],
        "driver": nvml.get("driver"),
        "cuda": nvml.get("cuda"),
        "torch": torch,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def gpu_processes(nvml: Dict[str, Any]) -> Set[Tuple[str, int]]:
    """(GPU UUID, pid) of every process NVML shows."""
    return {(p["uuid"], p["pid"]) for p in nvml.get("processes", [])}


def ours(pid: int) -> bool:
    """Whether `pid` is a live descendant of this process (something the proof started)."""
    try:
        return any(parent.pid == os.getpid() for parent in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def left_on_gpu(before: Set[Tuple[str, int]], wait_s: float = 15.0) -> List[Dict[str, Any]]:
    """Processes NVML shows now that it did not show before the run (waiting up to `wait_s` for them to go:
    NVML lists a process a little after it exited). Ours are killed; every one is reported."""
    deadline = time.monotonic() + wait_s
    while True:
        nvml = probe(timeout=30)
        if "error" in nvml:
            return [{"error": f"cannot check: {nvml['error']}"}]
        new = [p for p in nvml["processes"] if (p["uuid"], p["pid"]) not in before]
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for p in new:
        p["ours"] = ours(p["pid"])
        p["name"] = _name(p["pid"])
        if p["ours"]:
            _kill(p["pid"])
    return new


def _name(pid: int) -> Optional[str]:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None


def _kill(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).kill()
