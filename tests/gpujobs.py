"""Real CUDA jobs and NVML readings for the tests marked `gpu` (bench/gpu_proof.py runs them; elsewhere they
are skipped where NVML finds no GPU). Every job runs in a session of its own and is killed, group and all,
when its `with` block ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import uuid
from typing import Dict, Iterator, List, Optional

MIB = 1 << 20
PR_SET_NAME, PR_GET_NAME = 15, 16
READER_NAME = "gpu-test-nvml"  # what this process is called while gpu-mon must not count it as a user

BUSY = (
    "import torch\n"
    "a = torch.randn(4096, 4096, device='cuda')\n"
    "print('ready', flush=True)\n"
    "while True:\n    a @ a\n"
)
IDLE = (
    "import time, torch\n"
    "a = torch.randn(1024, 1024, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
HOLD = (
    "import time, torch\n"
    "x = torch.empty({mib} << 20, dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)
# A training job's start: half the GPU right after CUDA initialisation; one JSON line says how it went.
FOREIGN_HALF = (
    "import json, torch\n"
    "torch.cuda.init()\n"
    "free, total = torch.cuda.mem_get_info()\n"
    "try:\n"
    "    x = torch.empty(total // 2, dtype=torch.uint8, device='cuda')\n"
    "    torch.cuda.synchronize()\n"
    "    ok, err = True, ''\n"
    "except torch.OutOfMemoryError as e:\n"
    "    ok, err = False, str(e).splitlines()[0]\n"
    "print(json.dumps({'ok': ok, 'err': err}), flush=True)\n"
)


def repeats(quick: int, full: int) -> int:
    """How many repetitions: `full` when bench/gpu_proof.py asks for a full run, else `quick`."""
    return full if os.environ.get("GPU_MON_PROOF") == "full" else quick


def real_env(**extra: str) -> Dict[str, str]:
    """This environment without a simulated GPU, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
    env.update(extra)
    return env


def on_gpu(gpu_uuid: str) -> Dict[str, str]:
    """The environment of a job on this one GPU, named by UUID."""
    return real_env(CUDA_VISIBLE_DEVICES=gpu_uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")


class Nvml:
    """pynvml on GPU 0 (NVML index), for the duration of a test."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        raw = pynvml.nvmlDeviceGetUUID(self.handle)
        self.uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.total_mib = pynvml.nvmlDeviceGetMemoryInfo(self.handle).total / MIB

    def processes(self) -> Dict[int, float]:
        """pid -> MiB of every compute process NVML lists on GPU 0."""
        listed = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return {p.pid: (p.usedGpuMemory or 0) / MIB for p in listed}

    def used_mib(self) -> float:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MIB

    def close(self) -> None:
        self.nvml.nvmlShutdown()


@contextlib.contextmanager
def nvml() -> Iterator[Nvml]:
    reader = Nvml()
    try:
        yield reader
    finally:
        reader.close()


class Job:
    """`python -c SCRIPT` in its own session, its stdout lines queued; a marker in its command line."""

    def __init__(self, script: str, env: Dict[str, str]) -> None:
        self.marker = f"gpu-test-{uuid.uuid4().hex[:12]}"
        self.argv = [sys.executable, "-c", f"# {self.marker}\n{script}"]
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue[Optional[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def line(self, timeout: float = 120) -> str:
        """Its next stdout line; AssertionError when it ends or says nothing within `timeout`."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the job said nothing within {timeout:g} s") from None
        assert line is not None, f"the job ended (exit {self.proc.wait()}) before saying anything"
        return line

    def ready(self, timeout: float = 120) -> None:
        assert self.line(timeout) == "ready"

    def stop(self) -> None:
        """SIGKILL to its whole group; reaped."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def alive_with(marker: str) -> List[int]:
    """Pids of live processes whose command line has `marker` (what a test started and may have left)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or ()):
            found.append(p.pid)
    return found


@contextlib.contextmanager
def named_reader() -> Iterator[str]:
    """While NVML is open in this process it holds every GPU's device node: name it READER_NAME, so that a
    gpu-mon told `ignore_programs = READER_NAME` does not take it for someone using the GPU."""
    libc = ctypes.CDLL(None)
    old = ctypes.create_string_buffer(16)
    libc.prctl(PR_GET_NAME, old, 0, 0, 0)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(READER_NAME.encode()), 0, 0, 0)
    try:
        yield READER_NAME
    finally:
        libc.prctl(PR_SET_NAME, old, 0, 0, 0)
