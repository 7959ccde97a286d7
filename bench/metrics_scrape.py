#!/usr/bin/env python3
"""Benchmark: how long a scrape of the [metrics] endpoint takes, on 8 simulated GPUs with 16 workloads.

    sudo python bench/metrics_scrape.py [--scrapes 500]

A real `gpu-mon run` (8 simulated GPUs, two per_gpu [process-*] sections: 16 workload instances, of which 8
run and 8 wait, a GPU running one at a time; polling every 0.5 s, so rounds keep replacing the metrics
while we scrape) with `[metrics] listen` on a free port. We time
--scrapes sequential HTTP GETs of /metrics from a fresh connection each (as Prometheus does after an idle
keep-alive), connect to last byte. Baseline, in the same run: the same bytes served as a static file by
Python's standard http.server (what HTTP on this machine costs with no work behind it). Also the
textfile's size and how many samples it holds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import free_port, median, percentile, table, wait_until  # noqa: E402

GPUS = 8


def get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def time_scrapes(port: int, path: str, n: int) -> List[float]:
    out = []
    for _ in range(n):
        began = time.perf_counter()
        body = get(port, path)
        out.append((time.perf_counter() - began) * 1000)
        assert body, "empty answer"
    return out


def start_daemon(work: Path, port: int) -> subprocess.Popen:
    (work / "dev").mkdir()
    gpus = []
    for i in range(GPUS):
        (work / "dev" / f"nvidia{i}").touch()
        gpus.append({"uuid": f"GPU-bench-{i:04d}", "device": f"dev/nvidia{i}", "memory_total_mib": 81559})
    (work / "sim.json").write_text(json.dumps({"gpus": gpus}))
    conf = (
        f"[defaults]\ninterval_seconds = 0.5\nstart_delay_seconds = 0.2\nstate_file = {work / 'state.json'}\n"
        "[gpu-all]\ngpus = ALL\n"
        "[process-miner]\ncmd = sleep 3600\nper_gpu = yes\nuser = root\n"
        "[process-stress]\ncmd = sleep 3600\nper_gpu = yes\nuser = root\n"
        f"[history]\nenabled = no\n[metrics]\nlisten = {port}\ntextfile = {work / 'gpu_mon.prom'}\n"
    )
    (work / "gpu_mon.conf").write_text(conf)
    os.chmod(work / "gpu_mon.conf", 0o600)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("NOTIFY_SOCKET", None)
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - the daemon's, until it exits
    return subprocess.Popen(
        [sys.executable, "-m", "gpu_mon", "--config", str(work / "gpu_mon.conf"),
         "--sim", str(work / "sim.json"), "run"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip


def workloads(port: int) -> List[str]:
    """The value of each gpu_mon_workload_running sample."""
    text = get(port, "/metrics").decode()
    lines = text.splitlines()
    return [line.rsplit(" ", 1)[1] for line in lines if line.startswith("gpu_mon_workload_running{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=int, default=500)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root: the daemon must see every process", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-scrape-"))
    port, static_port = free_port(), free_port()
    daemon = start_daemon(work, port)
    static = None
    try:
        wanted = sorted(["0.0"] * GPUS + ["1.0"] * GPUS)
        wait_until(
            lambda: _answers(port) and sorted(workloads(port)) == wanted,
            60,
            "8 workloads running",
            every=0.05,
        )
        body = get(port, "/metrics")
        (work / "www").mkdir()
        (work / "www" / "metrics").write_bytes(body)
        static = subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(work / "www"),
             str(static_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(lambda: _answers(static_port), 30, "the static server", every=0.05)
        time_scrapes(port, "/metrics", 20)  # warm up both
        time_scrapes(static_port, "/metrics", 20)
        ours = time_scrapes(port, "/metrics", a.scrapes)
        base = time_scrapes(static_port, "/metrics", a.scrapes)
        samples = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    finally:
        for p in (daemon, static):
            if p is not None:
                p.terminate()
                p.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{GPUS} simulated GPUs, {2 * GPUS} workloads ({GPUS} running); {len(body)} bytes, {samples} samples "
        f"per scrape; {os.cpu_count()} CPUs"
    )
    rows = [
        [label, len(t), f"{median(t):.2f}", f"{percentile(t, 99):.2f}", f"{max(t):.2f}"]
        for label, t in (("gpu-mon /metrics", ours), ("baseline: the same bytes, static http.server", base))
    ]
    print(table(["endpoint", "scrapes", "p50 ms", "p99 ms", "max ms"], rows))
    return 0


def _answers(port: int) -> bool:
    try:
        get(port, "/metrics")
    except OSError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
