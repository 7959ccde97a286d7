#!/usr/bin/env python3
"""Benchmark: CPU of `gpu-mon watch` and `gpu-mon sentinel` at one sample a second on a busy host.

    python bench/idle_watchers.py [--procs 1000] [--seconds 60]

N background processes (~10 open fds each) fill /proc. On a simulated host (2 GPUs, per-process
utilization given for the watched command) we run, one after the other, each for --seconds:
  - `gpu-mon watch -s 1 -n 100000 -- CMD`, CMD holding GPU 0 (it never ends by idleness here);
  - `gpu-mon sentinel --interval 1` (it never arms: the GPUs stay at 0%);
  - `gpu-mon occupy on` while it waits (another user's memory on the GPU; looks every 3 s, the default);
  - baseline: the same watch loop done the obvious way, one complete look at the host per sample
    (`gpu_mon.api.observe.look()`: every process's fds scanned), in a child process.
CPU is user+system time of the measuring process and its leader (for watch), from /proc, divided by the
wall time: percent of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from background import Background, table

GPU_MON = [sys.executable, "-m", "gpu_mon"]
TICKS = os.sysconf("SC_CLK_TCK")
BASELINE = """
import sys, time
from gpu_mon.api.observe import look
from gpu_mon.api.sim import SimBackend
b = SimBackend(sys.argv[1])
while True:
    look(b)
    time.sleep(1)
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (not its children), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree(pid: int) -> List[int]:
    """The process and its direct children."""
    out = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def measure(argv: List[str], seconds: float, warmup: float = 3.0) -> float:
    """% of one core used by the process (and its direct children) over `seconds`, after a warm-up."""
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        time.sleep(warmup)  # start-up (imports) is not the steady state we measure
        pids = tree(p.pid)
        before = sum(cpu_seconds(q) for q in pids)
        t0 = time.monotonic()
        time.sleep(seconds)
        used = sum(cpu_seconds(q) for q in pids) - before
        return 100 * used / (time.monotonic() - t0)
    finally:
        p.terminate()
        p.wait(30)


def measure_pid(pid: int, seconds: float, warmup: float = 3.0) -> float:
    """% of one core used by a process that is not our child."""
    time.sleep(warmup)
    before = cpu_seconds(pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    return 100 * (cpu_seconds(pid) - before) / (time.monotonic() - t0)


def measure_occupier(sim: Path, work: Path, seconds: float) -> float:
    """The background occupier's CPU while it waits for GPUs that stay busy."""
    doc = json.loads(sim.read_text())
    busy = {"gpus": [{**g, "memory_used_mib": 30000} for g in doc["gpus"]]}
    sim.write_text(json.dumps(busy))
    env = {**os.environ, "GPU_MON_SIM": str(sim), "XDG_STATE_HOME": str(work / "state")}
    occupy = [*GPU_MON, "occupy"]
    subprocess.run([*occupy, "on", "--", "sleep", "1000"], env=env, check=True, capture_output=True)
    try:
        record = work / "state" / "gpu-mon" / "occupy" / "occupier.json"
        return measure_pid(int(json.loads(record.read_text())["pid"]), seconds)
    finally:
        subprocess.run([*occupy, "off"], env=env, capture_output=True)
        sim.write_text(json.dumps(doc))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-"))
    (work / "dev").mkdir()
    for i in (0, 1):
        (work / "dev" / f"nvidia{i}").touch()
    sim = work / "sim.json"
    gpus = [{"uuid": f"GPU-bench-{i}", "utilization_pct": 0, "device": f"dev/nvidia{i}"} for i in (0, 1)]
    sim.write_text(json.dumps({"gpus": gpus}))
    bg = Background(args.procs)
    try:
        in_proc = len([n for n in os.listdir("/proc") if n.isdigit()])
        hold = ["sh", "-c", f"exec sleep 100000 < {work}/dev/nvidia0"]
        rows = [
            (
                "gpu-mon watch -s 1",
                measure(
                    [*GPU_MON, "--sim", str(sim), "watch", "-s", "1", "-n", "100000", "--", *hold],
                    args.seconds,
                ),
            ),
            (
                "gpu-mon sentinel --interval 1",
                measure([*GPU_MON, "--sim", str(sim), "sentinel", "--interval", "1"], args.seconds),
            ),
            ("gpu-mon occupy on, waiting (a look every 3 s)", measure_occupier(sim, work, args.seconds)),
            (
                "baseline: a complete look per sample",
                measure([sys.executable, "-c", BASELINE, str(sim)], args.seconds),
            ),
        ]
    finally:
        bg.close()
    print(f"{args.procs} background processes, {in_proc} in /proc, {args.seconds:g} s each, 1 sample/s")
    print(table(["what", "CPU (% of one core)"], [(name, f"{pct:.2f}") for name, pct in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
