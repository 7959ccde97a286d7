#!/usr/bin/env python3
"""On a machine with an NVIDIA GPU: does a user's job ever hit out-of-memory because of our workload?

    python bench/gpu_preempt.py [--trials 20] [--memory 88%] [--foreign torch|libcuda] [--json FILE]

A real `gpu-mon run` (NVML backend) runs `gpu-mon stress --memory 88%` on GPU 0 (as a per-GPU workload).
Each trial starts a foreign torch process that, right after CUDA initialisation, allocates half the GPU's
memory at once, as a training job would. We record whether that allocation fails with out-of-memory, and
how long after the foreign process started initialising CUDA NVML shows our workload's memory released.
The foreign process then exits, and the daemon starts the workload again after its start delay.
`--foreign libcuda` makes the foreign process a few lines of ctypes on libcuda (cuInit, a context,
cuMemAlloc): no torch start-up, so its allocation comes as early as a CUDA program's can. `--json FILE`
also writes every trial and the summary, machine-readable (what bench/gpu_proof.py reads).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import median, percentile, table  # noqa: E402

from gpu_mon.api.nvml import NvmlBackend  # noqa: E402

FOREIGN = r"""
import json, sys, time
import torch
t_init = time.monotonic_ns()
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
t_ready = time.monotonic_ns()
try:
    x = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ok, err = True, ""
except torch.OutOfMemoryError as e:
    ok, err = False, str(e).splitlines()[0]
t_alloc = time.monotonic_ns()
print(json.dumps({"t_init": t_init, "t_ready": t_ready, "t_alloc": t_alloc, "ok": ok, "err": err,
                  "free_at_init_mib": free >> 20}), flush=True)
"""

FOREIGN_LIBCUDA = r"""
import ctypes, json, time
cuda = ctypes.CDLL("libcuda.so.1")
t_init = time.monotonic_ns()
assert cuda.cuInit(0) == 0
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
free, total = ctypes.c_size_t(), ctypes.c_size_t()
assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
t_ready = time.monotonic_ns()
ptr = ctypes.c_uint64()
rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(total.value // 2))
t_alloc = time.monotonic_ns()
err = "" if rc == 0 else ("CUDA_ERROR_OUT_OF_MEMORY" if rc == 2 else f"CUresult {rc}")
print(json.dumps({"t_init": t_init, "t_ready": t_ready, "t_alloc": t_alloc, "ok": rc == 0, "err": err,
                  "free_at_init_mib": free.value >> 20}), flush=True)
"""


def held_fraction(memory: str) -> float:
    """The share of the GPU the workload holds once fully allocated: 88% -> 0.88; 0.8 for absolute sizes."""
    return float(memory[:-1]) / 100 if memory.endswith("%") else 0.8


def gpu0(backend: NvmlBackend):
    return backend.read().gpus[0]


def wait_for_workload(backend: NvmlBackend, ours: set, min_mib: int, timeout: float = 120) -> Optional[int]:
    """Wait until a process that is not the foreign one holds >= min_mib; return NVML memory used."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = gpu0(backend)
        held = [p for p in g.processes or () if (p.used_memory_mib or 0) >= min_mib]
        if held:
            ours.clear()
            ours.update(p.pid for p in held)
            return g.memory_used_mib
        time.sleep(0.1)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--memory", default="88%")
    ap.add_argument("--foreign", choices=("torch", "libcuda"), default="torch", help="the foreign process")
    ap.add_argument("--json", metavar="FILE", help="also write every trial and the summary here as JSON")
    a = ap.parse_args()
    # This process reads NVML, so it holds /dev/nvidia0 like any monitor: give it a name of its own and
    # have gpu-mon ignore it (ignore_programs), as an admin would for nvtop or an exporter.
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"gpu-bench-nvml"), 0, 0, 0)  # PR_SET_NAME
    backend = NvmlBackend()
    first = backend.read()
    if first.error or not first.gpus:
        print(f"no GPU: {first.error}")
        return 2
    total = first.gpus[0].memory_total_mib
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-gpu-preempt-"))
    conf = work / "gpu_mon.conf"
    conf.write_text(
        f"[defaults]\ninterval_seconds = 1\nstart_delay_seconds = 2\nstop_timeout_seconds = 5\n"
        f"state_file = {work}/state.json\n[gpu-all]\ngpus = 0\nignore_programs = gpu-bench-nvml\n"
        "[process-stress]\nuser = root\n"
        f"cmd = {sys.executable} -m gpu_mon stress --memory {a.memory} --report-seconds 30\n"
        f"env = PYTHONPATH={ROOT}\n"
        f"[history]\npath = {work}/history.sqlite\n"
    )
    os.chmod(conf, 0o600)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it until the end
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpu_mon", "--config", str(conf), "run"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    rows, results, trials = [], [], []
    try:
        for trial in range(a.trials):
            ours: set = set()
            # fully allocated
            used = wait_for_workload(backend, ours, min_mib=int(total * held_fraction(a.memory) * 0.9))
            if used is None:
                print("the workload did not start; daemon log:")
                print((work / "daemon.log").read_text()[-3000:])
                return 1
            script = FOREIGN_LIBCUDA if a.foreign == "libcuda" else FOREIGN
            foreign = subprocess.Popen(  # CUDA's device 0 is NVML's GPU 0 in PCI bus order
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID"),
            )
            ours_mib = sum(p.used_memory_mib or 0 for p in gpu0(backend).processes or () if p.pid in ours)
            released_at: Optional[int] = None  # our pid gone from NVML's process list
            freed_at: Optional[int] = None  # NVML memory used down by 90% of what our process held
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # poll NVML every ~5 ms until ours is gone and theirs is done
                g = gpu0(backend)
                now = time.monotonic_ns()
                if (
                    freed_at is None
                    and g.memory_used_mib is not None
                    and g.memory_used_mib <= used - 0.9 * ours_mib
                ):
                    freed_at = now
                if released_at is None and not [p for p in g.processes or () if p.pid in ours]:
                    released_at = now
                if released_at is not None and freed_at is not None and foreign.poll() is not None:
                    break
                if (
                    released_at is not None
                    and foreign.poll() is not None
                    and time.monotonic() > deadline - 55
                ):
                    break
                time.sleep(0.005)
            out = json.loads(foreign.stdout.readline() or "{}")
            foreign.wait()
            if not out:
                print(f"trial {trial}: the foreign process printed nothing (exit {foreign.returncode})")
                continue
            rel_ms = (released_at - out["t_init"]) / 1e6 if released_at else float("nan")
            freed_ms = (freed_at - out["t_init"]) / 1e6 if freed_at else float("nan")
            ready_ms = (out["t_ready"] - out["t_init"]) / 1e6
            results.append((out["ok"], rel_ms, ready_ms, out["free_at_init_mib"], freed_ms))
            trials.append(
                {
                    "ok": out["ok"],
                    "err": out["err"],
                    "ours_mib": ours_mib,
                    "free_at_init_mib": out["free_at_init_mib"],
                    "freed_ms": freed_ms,
                    "off_list_ms": rel_ms,
                    "ready_ms": ready_ms,
                    "alloc_ms": (out["t_alloc"] - out["t_init"]) / 1e6,
                }
            )
            if a.json:  # after every trial: a run cut short still leaves the trials it finished
                summary = {"gpu": first.gpus[0].name, "total_mib": total, "memory": a.memory}
                doc = {**summary, "foreign": a.foreign, "trials_asked": a.trials, "trials": trials}
                Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
            print(
                f"trial {trial + 1}: ours held {ours_mib} MiB; foreign cuInit->ready {ready_ms:.0f} ms, "
                f"free at its init {out['free_at_init_mib']} MiB, half-memory allocation "
                f"{'OK' if out['ok'] else 'OUT OF MEMORY: ' + out['err']}; NVML memory used dropped "
                f"{freed_ms:.0f} ms and our pid left NVML's list {rel_ms:.0f} ms after its cuInit",
                flush=True,
            )
        ok = [r for r in results if r[0]]
        rel = [r[1] for r in results if r[1] == r[1]]
        freed = [r[4] for r in results if r[4] == r[4]]
        ready = [r[2] for r in results]
        rows.append(
            [
                len(results),
                len(results) - len(ok),
                f"{median(freed):.0f}",
                f"{percentile(freed, 99):.0f}",
                f"{median(rel):.0f}",
                f"{percentile(rel, 99):.0f}",
                f"{median(ready):.0f}",
            ]
        )
        print()
        print(
            f"GPU 0: {first.gpus[0].name}, {total} MiB; workload: gpu-mon stress --memory {a.memory}; "
            "times from the foreign process's cuInit"
        )
        headers = [
            "trials",
            "foreign OOMs",
            "memory freed p50 ms",
            "p99 ms",
            "pid off NVML list p50 ms",
            "p99 ms",
            "foreign cuInit->ready p50 ms",
        ]
        print(table(headers, rows))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        print("--- daemon log (last lines) ---")
        print("\n".join((work / "daemon.log").read_text().splitlines()[-25:]))
        shutil.rmtree(work, ignore_errors=True)
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
