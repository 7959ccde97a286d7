#!/usr/bin/env python3
"""On a machine with an NVIDIA GPU: which way of holding and giving back memory hands the GPU over fastest?

    python bench/gpu_release.py [--quick] [--plan] [--json FILE]

A matrix: each --hold (chunks of 512 MiB, 8 blocks, one block) and --release (free-then-exit, exit) of
`gpu-mon stress --memory 88%` on GPU 0, each against a newcomer that takes 90% of the GPU's total at once,
no retry (vLLM's default; bench/newcomer.py): first a torch one, then raw libcuda through ctypes. A trial
starts the newcomer (it loads torch or libcuda and waits) and the stressor, waits until the stressor holds its
target, then at one instant tells the newcomer to go (cuInit, context, one allocation) and sends the stressor
SIGTERM, as the daemon does when a newcomer opens the GPU (the daemon's own detection, a few ms, is not
included: bench/gpu_preempt.py measures the whole handoff). NVML is read every ~2 ms until the stressor's
memory is back. Per strategy and newcomer: memory freed (NVML used down by 90% of what the stressor held),
the newcomer ready (context made) and allocated, all from its cuInit; the stressor's SIGTERM -> exit; and how
many newcomers ran out of memory. Trials go round by round over every cell, so a run cut short by its budget
(5 minutes, --quick 3) still has every cell. `--plan` lists the matrix and what a trial does, without a GPU.
Choose the defaults from its table: no out-of-memory, and p99 freed before the newcomer's p50 ready.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import newcomer
from background import median, percentile, table
from stress import Nvml, Stressor

HOLDS = {
    "chunks": "512 MiB chunks (--chunk-mib): ~245 frees at 88% of 141 GB",
    "blocks": "8 equal blocks (~15 GiB each at 88% of 141 GB)",
    "one": "one block of the whole target",
}
RELEASES = {
    "free-then-exit": "on SIGTERM free every block and the allocator's cache, then exit",
    "exit": "on SIGTERM exit at once; the driver frees the memory with the process",
}
DEFAULT = ("one", "free-then-exit")  # gpu-mon stress's own --hold and --release (a test keeps them equal)
START_TIMEOUT_S = 180.0
FREED_TIMEOUT_S = 15.0
NVML_POLL_S = 0.002


def cells(opts: argparse.Namespace) -> List[Tuple[str, str, str]]:
    """(newcomer, hold, release) for every cell of the matrix, newcomer kind by kind."""
    return list(itertools.product(opts.newcomers, opts.holds, opts.releases))


def plan(opts: argparse.Namespace) -> int:
    """--plan: the strategies, the matrix and what each trial does (no GPU, no torch, no NVML)."""
    matrix = cells(opts)
    print(
        f"bench/gpu_release.py{' --quick' if opts.quick else ''}: {len(opts.holds) * len(opts.releases)} "
        f"strategies x {len(opts.newcomers)} newcomers = {len(matrix)} cells, up to {opts.rounds} rounds "
        f"(one trial of every cell each), within {opts.budget_s:g} s"
    )
    print(f"\nstrategies (gpu-mon stress --memory {opts.memory} --hold H --release R):")
    for number, (hold, release) in enumerate(itertools.product(opts.holds, opts.releases), 1):
        default = " (the default)" if (hold, release) == DEFAULT else ""
        print(f" {number}. --hold {hold} --release {release}{default}: {HOLDS[hold]}; {RELEASES[release]}")
    print(f"\nnewcomers (each takes {opts.alloc:.0%} of the GPU's total at once, no retry):")
    print("  torch: torch.cuda.init, mem_get_info, one torch.empty")
    print("  libcuda: cuInit, cuDevicePrimaryCtxRetain, cuMemGetInfo, one cuMemAlloc (ctypes, no torch)")
    print("\neach trial:")
    for step in (
        "start the newcomer (it loads torch or libcuda, says `loaded` and waits) and the stressor on GPU 0",
        "wait for the stressor's start line (its target held) and NVML's figure for its memory",
        "at one instant: the newcomer goes (its cuInit is time 0) and the stressor gets SIGTERM",
        f"read NVML every {NVML_POLL_S * 1e3:g} ms until used memory is 90% of the stressor's less",
        "record: freed, newcomer ready and allocated (from its cuInit), out of memory, SIGTERM -> exit",
        "wait until both have exited and NVML shows the memory back before the next trial",
    ):
        print(f"  - {step}")
    print("\ncells, in the order each round runs them:")
    for number, (kind, hold, release) in enumerate(matrix, 1):
        print(f" {number:2}. newcomer {kind:7} --hold {hold:6} --release {release}")
    return 0


def trial(opts: argparse.Namespace, kind: str, hold: str, release: str) -> Dict[str, Any]:
    """One handoff: the stressor at --memory, the newcomer going at the instant of SIGTERM."""
    comer = newcomer.start(kind, opts.alloc)
    args = ["--memory", opts.memory, "--hold", hold, "--release", release, "--workload", "matmul"]
    stressor = Stressor(["--device", "cuda", "--report-seconds", "600", *args])
    try:
        start = stressor.wait_line("stress: start ", START_TIMEOUT_S)
        if comer.stdout.readline().strip() != "loaded":
            raise RuntimeError(f"the {kind} newcomer did not load (exit {comer.poll()})")
        nvml = Nvml(start["uuid"])
        ours = nvml.process_mib(stressor.proc.pid) or float(start["memory_mib"])
        used = nvml.used_mib()
        comer.stdin.write("go\n")
        comer.stdin.flush()
        sent = time.monotonic_ns()
        stressor.proc.send_signal(signal.SIGTERM)
        freed_at = exit_at = None
        deadline = time.monotonic() + FREED_TIMEOUT_S
        while (freed_at is None or exit_at is None) and time.monotonic() < deadline:
            now = time.monotonic_ns()
            if freed_at is None and nvml.used_mib() <= used - 0.9 * ours:
                freed_at = now
            if exit_at is None and stressor.proc.poll() is not None:
                exit_at = now
            time.sleep(NVML_POLL_S)
        out = json.loads(comer.stdout.readline() or "{}")
        if not out:
            raise RuntimeError(f"the {kind} newcomer printed nothing (exit {comer.wait()})")
        t0 = out["t_init"]
        result = {
            "ok": out["ok"],
            "err": out["err"],
            "ours_mib": ours,
            "free_at_ready_mib": out["free_at_ready_mib"],
            "freed_ms": (freed_at - t0) / 1e6 if freed_at else float("nan"),
            "ready_ms": (out["t_ready"] - t0) / 1e6,
            "alloc_ms": (out["t_alloc"] - t0) / 1e6,
            "exit_ms": (exit_at - sent) / 1e6 if exit_at else float("nan"),
            "status": stressor.proc.wait(10),
        }
        settle(nvml, used - ours, comer)
        return result
    finally:
        stressor.stop()
        if comer.poll() is None:
            comer.kill()
        comer.wait()


def settle(nvml: Nvml, before_mib: float, comer: Any, timeout: float = 30.0) -> None:
    """Wait until the newcomer has exited and NVML shows the memory of both back."""
    comer.wait(timeout)
    deadline = time.monotonic() + timeout
    while nvml.used_mib() > before_mib + 1024 and time.monotonic() < deadline:
        time.sleep(0.05)


def summary(results: Dict[Tuple[str, str, str], List[Dict[str, Any]]]) -> str:
    """The table: one row per cell."""
    rows = []
    for (kind, hold, release), trials in results.items():
        freed = [t["freed_ms"] for t in trials if t["freed_ms"] == t["freed_ms"]]
        ready = [t["ready_ms"] for t in trials]
        alloc = [t["alloc_ms"] for t in trials]
        exits = [t["exit_ms"] for t in trials if t["exit_ms"] == t["exit_ms"]]
        ooms = sum(not t["ok"] for t in trials)
        first = freed and ready and percentile(freed, 99) < median(ready)
        rows.append(
            [kind, hold, release, len(trials), f"{ooms}/{len(trials)}",
             *(f"{f(v):.0f}" if v else "-" for f, v in (
                 (median, freed), (lambda v: percentile(v, 99), freed), (median, ready), (median, alloc),
                 (median, exits))),
             "yes" if first and not ooms else "no"]
        )  # fmt: skip
    headers = ["newcomer", "hold", "release", "trials", "OOM", "freed p50 ms", "freed p99 ms",
               "ready p50 ms", "allocated p50 ms", "SIGTERM->exit p50 ms", "in time"]  # fmt: skip
    return table(headers, rows)


def run(opts: argparse.Namespace) -> int:
    """The matrix, round by round, within the budget; then the table."""
    started = time.monotonic()
    results: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {cell: [] for cell in cells(opts)}
    slowest = 0.0
    for round_number in range(opts.rounds):
        for kind, hold, release in results:
            if time.monotonic() - started + slowest > opts.budget_s:
                print(f"budget of {opts.budget_s:g} s reached in round {round_number + 1}", flush=True)
                return finish(opts, results)
            begun = time.monotonic()
            try:
                result = trial(opts, kind, hold, release)
            except Exception as exc:
                print(f"  {kind} {hold} {release}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            slowest = max(slowest, time.monotonic() - begun)
            results[(kind, hold, release)].append(result)
            print(
                f"  round {round_number + 1} {kind:7} --hold {hold:6} --release {release:14} "
                f"freed {result['freed_ms']:.0f} ms, ready {result['ready_ms']:.0f} ms, allocated "
                f"{result['alloc_ms']:.0f} ms{'' if result['ok'] else ' OUT OF MEMORY'}, "
                f"exit {result['exit_ms']:.0f} ms (status {result['status']})",
                flush=True,
            )
    return finish(opts, results)


def finish(opts: argparse.Namespace, results: Dict[Tuple[str, str, str], List[Dict[str, Any]]]) -> int:
    """Print the table (and write --json)."""
    print(
        f"\nstressor --memory {opts.memory}; newcomers take {opts.alloc:.0%} of the total; "
        "times from the newcomer's cuInit"
    )
    print(summary(results))
    if opts.json:
        rows = [{"newcomer": k, "hold": h, "release": r, "trials": t} for (k, h, r), t in results.items()]
        doc = {"memory": opts.memory, "alloc": opts.alloc, "cells": rows}
        Path(opts.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Options; --quick lowers the rounds and the budget."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="list the matrix and what a trial does (no GPU)")
    ap.add_argument("--quick", action="store_true", help="at most 3 rounds within 3 minutes")
    ap.add_argument("--rounds", type=int, default=None, help="trials per cell (default 5, --quick 3)")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 300, --quick 180)")
    ap.add_argument("--memory", default="88%", help="the stressor's --memory (default 88%%)")
    ap.add_argument("--alloc", type=float, default=0.9, help="the newcomer's share of the total (0.9)")
    ap.add_argument("--newcomers", default="torch,libcuda", help="comma list of torch, libcuda")
    ap.add_argument("--holds", default=",".join(HOLDS), help="comma list of chunks, blocks, one")
    ap.add_argument("--releases", default=",".join(RELEASES), help="comma list of free-then-exit, exit")
    ap.add_argument("--json", metavar="FILE", help="also write every trial as JSON")
    opts = ap.parse_args(argv)
    opts.rounds = opts.rounds or (3 if opts.quick else 5)
    opts.budget_s = opts.budget_s or (180.0 if opts.quick else 300.0)
    for name, known in (("newcomers", newcomer.KINDS), ("holds", HOLDS), ("releases", RELEASES)):
        values = [v for v in getattr(opts, name).split(",") if v]
        unknown = [v for v in values if v not in known]
        if unknown or not values:
            ap.error(f"--{name} {getattr(opts, name)!r}: expected a comma list of {', '.join(known)}")
        setattr(opts, name, values)
    return opts


def main(argv: Optional[List[str]] = None) -> int:
    """--plan, or the matrix on GPU 0."""
    opts = parse_args(argv)
    if opts.plan:
        return plan(opts)
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:
        print(f"no NVIDIA GPU: {type(exc).__name__}: {exc}; nothing measured", file=sys.stderr)
        return 2
    if count == 0:
        print("no NVIDIA GPU: NVML lists none; nothing measured", file=sys.stderr)
        return 2
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
