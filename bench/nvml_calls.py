#!/usr/bin/env python3
"""On a machine with an NVIDIA GPU: what each NVML call costs; does `gpu-mon status` see a CUDA process?

    python bench/nvml_calls.py [--reads 200] [--json FILE]

1. Starts `python -c "import torch; x = torch.zeros(1, device='cuda'); input()"`; waits until NVML lists it.
2. Runs `gpu-mon status --json` with the real backend (no config) and checks that the process is listed on
   its GPU both by the device-node scan and by NVML.
3. Times every NVML call gpu-mon makes, per GPU, over --reads looks (median and p99, microseconds), and two
   whole looks apart: a poll's look (`read(process_utilization=False)`, what most polling rounds cost) and
   a full look (`read()`, with per-process utilization: what the daemon takes every 5th poll, at least
   every 10 s, and what `status` without a daemon takes).
--json FILE also writes these figures, machine-readable (what bench/gpu_proof.py reads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import median, percentile, table  # noqa: E402

from gpu_mon.api.nvml import NvmlBackend  # noqa: E402


def time_looks(backend: NvmlBackend, reads: int) -> Tuple[Dict[tuple, List[float]], List[float], List[float]]:
    """(seconds of each call, of each full look, of each poll's look) over `reads` looks of each kind,
    alternated so that both see the same GPU state."""
    timings: Dict[tuple, List[float]] = defaultdict(list)
    whole: List[float] = []
    poll: List[float] = []
    for _ in range(reads):
        for looks, utilization in ((whole, True), (poll, False)):
            t = time.perf_counter()
            backend.read(process_utilization=utilization)
            looks.append(time.perf_counter() - t)
            if utilization:
                for key, seconds in backend.last_timings.items():
                    timings[key].append(seconds)
    return timings, whole, poll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--json", metavar="FILE", help="also write the figures here as JSON")
    a = ap.parse_args()
    result: dict = {"reads": a.reads}
    backend = NvmlBackend()
    reading = backend.read()
    if reading.error or not reading.gpus:
        print(f"no GPU: {reading.error or 'NVML lists none'}")
        return 2
    for g in reading.gpus:
        print(
            f"GPU {g.index}: {g.uuid} {g.name} minor {g.minor} node {g.device} "
            f"{g.memory_used_mib}/{g.memory_total_mib} MiB util {g.utilization_pct}% errors {list(g.errors)}"
        )
    cuda = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch; x = torch.zeros(1, device='cuda'); print('ready', flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert cuda.stdout.readline() == b"ready\n"
        t0 = time.monotonic()
        while not any(p.pid == cuda.pid for g in backend.read().gpus for p in g.processes or ()):
            if time.monotonic() - t0 > 30:
                print("NVML never listed the CUDA process")
                break
            time.sleep(0.05)
        print(f"NVML lists the CUDA process after {time.monotonic() - t0:.2f} s")
        result["listed_after_s"] = round(time.monotonic() - t0, 3)
        result["status"] = []
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        # No config on that machine: status takes one fresh look at the host with the real backend.
        st = subprocess.run(
            [sys.executable, "-m", "gpu_mon", "status", "--json"], capture_output=True, text=True, env=env
        )
        doc = json.loads(st.stdout)
        for g in doc["gpus"]:
            by_node = [h for h in g["holders"] if h["pid"] == cuda.pid]
            by_nvml = [h for h in g["nvml_processes"] if h["pid"] == cuda.pid]
            result["status"].append(
                {
                    "uuid": g["uuid"],
                    "by_node": bool(by_node),
                    "by_nvml": bool(by_nvml),
                    "mib": by_nvml[0].get("used_memory_mib") if by_nvml else None,
                }
            )
            print(
                f"status: GPU {g['index']} {g['uuid']}: busy={g['busy']}; CUDA pid {cuda.pid} in device "
                f"holders: {bool(by_node)}; in NVML processes: {bool(by_nvml)} "
                f"({by_nvml[0].get('used_memory_mib') if by_nvml else '-'} MiB); reasons: {g['reasons']}"
            )
        text = subprocess.run(
            [sys.executable, "-m", "gpu_mon", "status"], capture_output=True, text=True, env=env
        )
        print(text.stdout)
        timings, whole, poll = time_looks(backend, a.reads)
        rows = [
            [name, "all" if index < 0 else index, f"{median(v) * 1e6:.0f}", f"{percentile(v, 99) * 1e6:.0f}"]
            for (name, index), v in sorted(timings.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        ]
        for label, looks in (("a poll's look (no per-process utilization)", poll), ("a full look", whole)):
            rows.append([label, "all", f"{median(looks) * 1e6:.0f}", f"{percentile(looks, 99) * 1e6:.0f}"])
        result["calls_us"] = {
            f"{name} GPU {'all' if index < 0 else index}": [median(v) * 1e6, percentile(v, 99) * 1e6]
            for (name, index), v in timings.items()
        }
        result["whole_look_us"] = [median(whole) * 1e6, percentile(whole, 99) * 1e6]
        result["poll_look_us"] = [median(poll) * 1e6, percentile(poll, 99) * 1e6]
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"NVML call times over {a.reads} looks, {len(reading.gpus)} GPU(s), one CUDA process running:")
        print(table(["call", "GPU", "median us", "p99 us"], rows))
    finally:
        cuda.kill()
        cuda.wait()
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
