#!/usr/bin/env python3
"""Benchmark: how fast a preemptible Slurm job yields to someone outside Slurm, through gpu-mon, beside
how fast Slurm itself preempts it for a job of a higher partition.

    sudo python bench/slurm_yield.py [--trials 20] [--nodes 2]

A real one-node Slurm (tests/slurmcluster.py: munged, slurmctld, slurmd as plain processes in a temporary
directory; partitions `scavenger`, PreemptMode=REQUEUE, and `normal`) and a real `gpu-mon run` with
`[slurm] preemptible_partitions = scavenger` (every other key at its default) on simulated GPUs that are
the cluster's GRES devices.

gpu-mon, each trial: a scavenger batch job holds GPU 0; a second after gpu-mon has described it, a process
outside Slurm opens GPU 0. Measured from just before its open() (CLOCK_MONOTONIC, system-wide) to: the
action issued (`scontrol` running: gpu-mon's scontrol is a tiny C program that stamps the clock and execs
the real one), and the job's processes signalled (SIGTERM, stamped by the job's own handler); and, from
gpu-mon's own log, its wake on the open to the start of `scontrol`.
Slurm alone, each trial: a scavenger job holds GPU 0; a `normal` job asking for both GPUs is submitted.
Measured from just before `sbatch` to the scavenger job's SIGTERM, and to the normal job's start.

With `--nodes 2`: two slurmd on this host (`nodea`, `nodeb`, one GRES GPU each; simulated GPU 0 is
nodea's, GPU 1 nodeb's). gpu-mon's trials also measure the open to the requeued job running again on the
other node. Slurm's own trials pin the normal job to the scavenger job's node (the other one is idle);
the job it requeues is not waited for (Slurm alone gives it an EligibleTime ~121 s after the requeue, and
starts it at a scheduler pass after that: minutes, not measured here).

Needs root, Debian's slurmctld, slurmd, slurm-client and munge, and a C compiler (`cc`); says what is
missing in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import slurmcluster  # noqa: E402
from background import Background, median, percentile, start_daemon, table, wait_until  # noqa: E402

SHIM = r"""
#include <stdio.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    FILE *f = fopen(STAMPS, "a");
    if (f) {
        fprintf(f, "%lld", (long long)t.tv_sec * 1000000000LL + t.tv_nsec);
        for (int i = 1; i < argc; i++) fprintf(f, " %s", argv[i]);
        fputc('\n', f);
        fclose(f);
    }
    execv(REAL, argv);
    return 127;
}
"""
OPENER = (
    "import os, sys, time\n"
    "t = time.monotonic_ns()\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
    "print(t, flush=True)\n"
    "time.sleep(600)\n"
)
UUIDS = ["GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01", "GPU-9e47b2d1-1c3f-4a8e-b5d6-0f2a7c9e1b52"]


def wait(condition: Callable[[], object], timeout: float, what: str) -> object:
    return wait_until(condition, timeout, what, prog="slurm_yield")


def stamp(log: Path, word: str, job: int) -> Optional[int]:
    for e in slurmcluster.events(log):
        if e[0] == word and e[1] == str(job):
            return int(e[-1])
    return None


def shim(work: Path) -> str:
    real = shutil.which("scontrol")
    src, exe = work / "scontrol-stamp.c", work / "scontrol-stamp"
    src.write_text(SHIM)
    defs = [f'-DSTAMPS="{work / "stamps"}"', f'-DREAL="{real}"']
    subprocess.run(["cc", "-O2", *defs, "-o", str(exe), str(src)], check=True)
    return str(exe)


def described(state: Path, job: int) -> bool:
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return any(j["id"] == job and j["preemptible"] for j in doc["gpus"][0].get("slurm_jobs", []))


def ran_again(log: Path, job: int) -> Optional[Tuple[int, str]]:
    """(CLOCK_MONOTONIC ns, node) of the job's second start."""
    node, starts = "", []
    for e in slurmcluster.events(log):
        if e[0] == "node" and e[1] == str(job):
            node = e[2]
        elif e[0] == "start" and e[1] == str(job):
            starts.append((int(e[-1]), node))
    return starts[1] if len(starts) > 1 else None


def first_node(log: Path, job: int) -> str:
    return next((e[2] for e in slurmcluster.events(log) if e[0] == "node" and e[1] == str(job)), "")


def gpu_mon_trials(cluster: slurmcluster.SlurmCluster, work: Path, trials: int) -> List[tuple]:
    sim = {
        "gpus": [
            {"uuid": u, "name": "Sim", "memory_total_mib": 81559, "memory_used_mib": 0, "utilization_pct": 0,
             "device": d}
            for u, d in zip(UUIDS, cluster.devices)
        ]
    }  # fmt: skip
    (work / "sim.json").write_text(json.dumps(sim))
    state = work / "state.json"
    conf = (
        f"[defaults]\nstate_file = {state}\n[history]\npath = {work / 'history.sqlite'}\n"
        f"[gpu-all]\ngpus = ALL\n[slurm]\npreemptible_partitions = scavenger\nscontrol = {shim(work)}\n"
    )
    os.environ["SLURM_CONF"] = str(cluster.conf)
    daemon, dlog = start_daemon(work, conf, str(ROOT))
    rows = []
    try:
        for n in range(trials):
            log = work / f"gm-{n}.log"
            job = cluster.submit("scavenger", 0, log)
            wait(lambda log=log, job=job: stamp(log, "start", job), 60, "the scavenger job")
            wait(lambda job=job: described(state, job), 30, "gpu-mon to know the job")
            time.sleep(1.0)  # the open at an ordinary moment, not during the scans the job's own open set off
            node = first_node(log, job)
            dev = cluster.node_devices[node][0] if cluster.nodes else cluster.devices[0]
            opener = subprocess.Popen(
                [slurmcluster.PYTHON, "-c", OPENER, dev], stdout=subprocess.PIPE, text=True
            )
            again: Optional[Tuple[int, str]] = None
            try:
                t_open = int(opener.stdout.readline())  # type: ignore[union-attr]
                term = wait(lambda log=log, job=job: stamp(log, "term", job), 30, "the job's SIGTERM")
                issued = wait(lambda job=job: _issued(work / "stamps", job), 10, "the requeue")
                if cluster.nodes:
                    again = wait(lambda log=log, job=job: ran_again(log, job), 300, "the job running again")
            finally:
                opener.kill()
                opener.wait()
            own = wait(lambda job=job: _logged(work / "daemon.log", job), 10, "gpu-mon's log line")
            row = ((issued - t_open) / 1e6, (term - t_open) / 1e6, own)  # type: ignore[operator]
            if again is not None:
                if again[1] == node:
                    raise SystemExit(f"slurm_yield: job {job} ran again on {node}, the node it was kept off")
                row += ((again[0] - t_open) / 1e6,)
            rows.append(row)
            cluster.cancel_all()
    finally:
        daemon.terminate()
        daemon.wait(30)
        dlog.close()
    return rows


def _logged(log: Path, job: int) -> Optional[Tuple[float, str]]:
    """`slurm: job 7: requeue done (issued 3.1 ms after the open; ...)` -> 3.1."""
    found = re.search(rf"slurm: job {job}: requeue (done|failed)(.*)", log.read_text())
    if found is None:
        return None
    if found.group(1) != "done":
        raise SystemExit(f"slurm_yield: gpu-mon's requeue of job {job} failed: {found.group(2)}")
    issued = re.search(r"issued ([\d.]+) ms after the (open|poll)", found.group(2))
    return (float(issued.group(1)), issued.group(2)) if issued else (0.0, "?")


def _issued(stamps: Path, job: int) -> Optional[int]:
    try:
        lines = stamps.read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        words = line.split()
        if words[1:3] in (["requeuehold", str(job)], ["requeue", str(job)]):
            return int(words[0])
    return None


def slurm_trials(cluster: slurmcluster.SlurmCluster, work: Path, trials: int) -> List[tuple]:
    rows = []
    for n in range(trials):
        scav_log, normal_log = work / f"scav-{n}.log", work / f"normal-{n}.log"
        scav = cluster.submit("scavenger", 0, scav_log)
        wait(lambda log=scav_log, job=scav: stamp(log, "start", job), 60, "the scavenger job")
        t_submit = time.monotonic_ns()
        if cluster.nodes:  # the normal job wants the scavenger job's node: Slurm preempts it there
            normal = cluster.submit("normal", 0, normal_log, 1, f"--nodelist={first_node(scav_log, scav)}")
        else:
            normal = cluster.submit("normal", 1, normal_log, gpus=2)
        term = wait(lambda log=scav_log, job=scav: stamp(log, "term", job), 120, "Slurm's preemption")
        started = wait(lambda log=normal_log, job=normal: stamp(log, "start", job), 120, "the normal job")
        rows.append(((term - t_submit) / 1e6, (started - t_submit) / 1e6))  # type: ignore[operator]
        cluster.cancel_all()
    return rows


def fmt(values: List[float]) -> str:
    return f"{median(values):.1f} / {percentile(values, 99):.1f} / {max(values):.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials of each (default 20)")
    p.add_argument(
        "--background", type=int, default=0, help="this many idle processes beside (default 0)", metavar="N"
    )
    p.add_argument(
        "--proctrack",
        default="linuxproc",
        choices=("linuxproc", "pgid"),
        help="Slurm's ProctrackType (default linuxproc: it reads all of /proc to signal a job)",
    )
    p.add_argument(
        "--nodes", type=int, default=1, choices=(1, 2), help="Slurm nodes on this host (default 1)"
    )
    a = p.parse_args()
    lacking = slurmcluster.missing() + ([] if shutil.which("cc") else ["cc"])
    if lacking:
        print(f"slurm_yield: needs {', '.join(lacking)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-mon-slurm-bench-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        if a.nodes == 2:
            cluster = slurmcluster.SlurmCluster(work / "slurm", 1, ("nodea", "nodeb"), a.proctrack)
        else:
            cluster = slurmcluster.SlurmCluster(work / "slurm", proctrack=a.proctrack)
        load = Background(a.background) if a.background else None
        try:
            cluster.start()
            ours = gpu_mon_trials(cluster, work, a.trials)
            theirs = slurm_trials(cluster, work, a.trials)
        finally:
            left = cluster.close()
            if load is not None:
                load.close()
    print(
        f"{a.trials} trials each; ms, p50 / p99 / max; {os.cpu_count()} CPUs; {a.nodes} node(s); "
        f"{a.background} background processes; proctrack/{a.proctrack}"
    )
    heads = ("who stops the scavenger job", "trigger", "-> action issued", "-> job's processes signalled")
    mine = ["gpu-mon + scontrol requeue", "a process outside Slurm opens its GPU"]
    mine += [fmt([r[0] for r in ours]), fmt([r[1] for r in ours])]
    slurms = ["Slurm (partition_prio, REQUEUE)", "sbatch of a normal job needing its GPU", "-"]
    slurms += [fmt([r[0] for r in theirs])]
    if a.nodes == 2:
        heads += ("-> job running on the other node",)
        mine.append(fmt([r[3] for r in ours]))
        slurms.append("(EligibleTime +121 s: minutes)")
    print(table(heads, [mine, slurms]))
    inner = [r[2][0] for r in ours if r[2][1] == "open"]
    if inner:
        print(f"gpu-mon's own log: its wake on the open -> scontrol started: {fmt(inner)}")
    polls = sum(1 for r in ours if r[2][1] != "open")
    if polls:
        print(f"{polls} of {len(ours)} opens were seen by a poll that came first (not by the open event)")
    print(f"Slurm alone: sbatch -> the normal job running: {fmt([r[1] for r in theirs])}")
    if left:
        print(f"left running and killed: {', '.join(left)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
