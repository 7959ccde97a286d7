"""A newcomer on the GPU, for the handoff benchmarks: a process that takes a share of the GPU's total at once.

Two kinds: `torch` (torch.cuda.init, mem_get_info, one torch.empty) and `libcuda` (a few lines of ctypes:
cuInit, the primary context, cuMemGetInfo, one cuMemAlloc: no torch start-up, so it allocates as early as a
CUDA program can). Either one reads its share from argv[1] and loads what it needs; then, with `go` (the
default: bench/gpu_release.py), it prints `loaded` and waits for a line on stdin before cuInit, so that a
benchmark can start it early and time only the handoff; without (bench/gpu_preempt.py's foreign process) it
goes on at once. It then prints one JSON line: t_init (just before cuInit), t_ready (context made, free
memory read), t_alloc (the allocation done), all time.monotonic_ns() (CLOCK_MONOTONIC, the same clock in
every process), ok, err and free_at_ready_mib.
It takes its share once, with no retry, as vLLM (90% of the total) or JAX (75%) do by default.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional

KINDS = ("torch", "libcuda")

# Where the newcomer waits for its go, if it does: after loading, before t_init.
_GO = "GO_LINES\n"
_WAIT = 'print("loaded", flush=True)\nsys.stdin.readline()\n'

_TORCH = r"""
import json, sys, time
import torch
share = float(sys.argv[1])
GO_LINES
t_init = time.monotonic_ns()
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
t_ready = time.monotonic_ns()
try:
    x = torch.empty(int(total * share), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ok, err = True, ""
except torch.OutOfMemoryError as e:
    ok, err = False, str(e).splitlines()[0]
t_alloc = time.monotonic_ns()
print(json.dumps({"t_init": t_init, "t_ready": t_ready, "t_alloc": t_alloc, "ok": ok, "err": err,
                  "free_at_ready_mib": free >> 20}), flush=True)
"""

_LIBCUDA = r"""
import ctypes, json, sys, time
share = float(sys.argv[1])
cuda = ctypes.CDLL("libcuda.so.1")
GO_LINES
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
rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(total.value * share)))
t_alloc = time.monotonic_ns()
err = "" if rc == 0 else ("CUDA_ERROR_OUT_OF_MEMORY" if rc == 2 else f"CUresult {rc}")
print(json.dumps({"t_init": t_init, "t_ready": t_ready, "t_alloc": t_alloc, "ok": rc == 0, "err": err,
                  "free_at_ready_mib": free.value >> 20}), flush=True)
"""


def script(kind: str, go: bool = True) -> str:
    """The newcomer's Python source, `kind` torch or libcuda; with `go`, it waits for a line before cuInit."""
    return {"torch": _TORCH, "libcuda": _LIBCUDA}[kind].replace(_GO, _WAIT if go else "")


def start(kind: str, share: float, env: Optional[Dict[str, str]] = None, go: bool = True) -> subprocess.Popen:
    """A newcomer on CUDA device 0 (PCI bus order: NVML's GPU 0) taking `share` (0.9) of the GPU's total;
    with `go`, read `loaded`, then write it a line (its stdin is a pipe); without, it starts at once."""
    env = dict(os.environ if env is None else env, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return subprocess.Popen(
        [sys.executable, "-c", script(kind, go), repr(share)],
        stdin=subprocess.PIPE if go else None,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
