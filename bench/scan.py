#!/usr/bin/env python3
"""Benchmark: gpu_mon's holder scan against `fuser` on the same files, in the same run.

    sudo python bench/scan.py [--procs 1000] [--holders 50] [--hard-links 10] [--twins 10] [--repeat 7]

N background processes each hold ~10 fds; `--holders` of them also hold a stand-in GPU node: a character
device made with mknod (the device number of /dev/full, which nothing else holds). Of those, `--hard-links`
hold it through a hard link (same inode, another name), and `--twins` through a second node with the same
device number (another inode: what a container's own /dev/nvidia0 is). We time one full scan by gpu_mon,
one incremental scan (nothing changed) and `fuser` on the node (the seed tool's method), each the median of
--repeat runs, and count whom each finds. Needs root (mknod); without it, a regular file stands in and the
twin case is left out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from background import Background, median, table

from gpu_mon.api import holders
from gpu_mon.api.model import Gpu


def fuser_pids(path: str) -> set:
    """Pids that `fuser` reports for a file (it prints them on stdout, the file name on stderr)."""
    out = subprocess.run(["fuser", path], capture_output=True, text=True).stdout
    return {int(tok.rstrip("cefFrmn")) for tok in out.split() if tok.rstrip("cefFrmn").isdigit()}


def timed(fn, repeat: int) -> tuple:
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return median(times) * 1000, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1000)
    ap.add_argument("--holders", type=int, default=50)
    ap.add_argument("--hard-links", type=int, default=10)
    ap.add_argument("--twins", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    if not shutil.which("fuser"):
        print("fuser not found: install psmisc (apt-get install psmisc)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-"))
    device = work / "nvidia0"
    link = work / "renamed" / "nvidia0"
    twin = work / "container-dev" / "nvidia0"
    link.parent.mkdir()
    twin.parent.mkdir()
    full_rdev = os.stat("/dev/full").st_rdev
    try:
        os.mknod(device, 0o600 | stat.S_IFCHR, full_rdev)
        os.mknod(twin, 0o600 | stat.S_IFCHR, full_rdev)
    except PermissionError:
        print("not root: a regular file stands in for the GPU node, and the container case is left out")
        device.touch()
        a.twins = 0
    os.link(device, link)
    step = max(1, a.procs // max(1, a.holders))
    chosen = [i * step for i in range(a.holders)]
    kinds = ["twin"] * a.twins + ["link"] * a.hard_links
    kinds += ["direct"] * (len(chosen) - len(kinds))
    path_of = {"direct": str(device), "link": str(link), "twin": str(twin)}
    plan = {n: path_of[kind] for n, kind in zip(chosen, kinds)}
    print(
        f"starting {a.procs} background processes; {a.holders} hold the GPU node: "
        f"{kinds.count('direct')} directly, {a.hard_links} through a hard link, {a.twins} through a twin "
        "node (container /dev)...",
        flush=True,
    )
    bg = Background(a.procs, holders=plan)
    try:
        expected = {bg.pids[n] for n in chosen}
        via_link = {bg.pids[n] for n, path in plan.items() if path == str(link)}
        via_twin = {bg.pids[n] for n, path in plan.items() if path == str(twin)}
        targets, _ = holders.device_targets([Gpu(index=0, uuid="GPU-bench", device=str(device))])
        scanner = holders.HolderScanner(skip_pids=(os.getpid(),))
        scanner.set_targets(targets)
        nprocs = sum(1 for n in os.listdir("/proc") if n.isdigit())
        full_ms, full = timed(lambda: scanner.full(every=True), a.repeat)
        ran_ms, ran = timed(scanner.full, a.repeat)
        maps_ms, with_maps = timed(lambda: scanner.full(maps=True), a.repeat)
        scanner.full()
        inc_ms, inc = timed(scanner.changed, a.repeat) if scanner.incremental else (float("nan"), full)
        fuser_ms, by_fuser = timed(lambda: fuser_pids(str(device)), a.repeat)

        def found(pids: set) -> list:
            return [
                f"{len(expected & pids)}/{len(expected)}",
                f"{len(via_link & pids)}/{len(via_link)}",
                f"{len(via_twin & pids)}/{len(via_twin)}",
            ]

        rows = [
            [
                "gpu_mon full scan, every process (fds of every thread's table)",
                f"{full_ms:.1f}",
                *found(set(full.held)),
            ],
            ["gpu_mon full scan, the processes that ran since", f"{ran_ms:.1f}", *found(set(ran.held))],
            ["the same + memory maps (periodic)", f"{maps_ms:.1f}", *found(set(with_maps.held))],
            ["gpu_mon incremental (nothing changed)", f"{inc_ms:.1f}", *found(set(inc.held))],
            ["fuser <node>", f"{fuser_ms:.1f}", *found(by_fuser)],
        ]
        print()
        print(
            f"{nprocs} processes in /proc; median of {a.repeat} runs; {os.cpu_count()} CPUs; "
            f"kernel {os.uname().release}"
        )
        print(table(["method", "ms", "holders found", "via hard link", "via twin node"], rows))
        print()
        print(
            f"speed-up of the full scan over fuser: {fuser_ms / full_ms:.1f}x; incremental: "
            f"{fuser_ms / inc_ms:.0f}x"
            if inc_ms == inc_ms
            else ""
        )
        extra = set(full.held) - expected - {os.getpid()}
        if extra:
            print(f"(the full scan also found {len(extra)} other holders of the file: {sorted(extra)[:5]})")
        assert set(full.held) >= expected, "gpu_mon missed holders"
    finally:
        bg.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
