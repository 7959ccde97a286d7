#!/usr/bin/env python3
"""Benchmark: the queue with many jobs queued: `submit` -> id latency, and `jobs`.

    sudo python bench/queue_submit.py [--jobs 10000]

A real `gpu-mon run` (root) on two simulated GPUs that someone else holds (so nothing starts and every job
stays queued), with a [queue]. We submit --jobs jobs through the socket as a client does (one connection,
one request, the answer: the job committed to SQLite with synchronous=FULL first) and time each; then the
`jobs` request (every job with its waiting reason) and the whole `gpu-mon jobs` command. Prints a table;
--json for the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from background import median, percentile, table  # noqa: E402

from gpu_mon.queue.protocol import NoDaemon, request  # noqa: E402

# Not bench/queue.py: run as a script, that name would hide the standard library's queue module.
PROG = "bench/queue_submit.py"

HOLD = "import sys, time; f = open(sys.argv[1]); print('open', flush=True); time.sleep(3600)"


def _setup(base: Path) -> Path:
    (base / "dev").mkdir()
    gpus = []
    for i in range(2):
        (base / "dev" / f"nvidia{i}").touch()
        gpus.append(
            {
                "uuid": f"GPU-{i:08x}-1111-2222-3333-{i:012x}",
                "name": "Sim",
                "memory_total_mib": 81559,
                "memory_used_mib": 0,
                "utilization_pct": 0,
                "device": f"dev/nvidia{i}",
            }
        )
    (base / "sim.json").write_text(json.dumps({"gpus": gpus}))
    conf = base / "gpu_mon.conf"
    conf.write_text(
        f"[defaults]\nstate_file = {base / 'state.json'}\n[history]\nenabled = no\n[gpu-all]\ngpus = ALL\n"
        f"[queue]\nsocket = {base / 'run' / 'queue.sock'}\ndatabase = {base / 'queue.sqlite'}\n"
        "max_queued_per_user = 1000000\n"
    )
    conf.chmod(0o600)
    return conf


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"{PROG}: timed out waiting for {what}")
        time.sleep(0.05)


def _submit(sock: str, i: int) -> float:
    req = {"op": "submit", "command": ["true", str(i)], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}}
    t = time.perf_counter()
    answer = request(sock, req)
    took = time.perf_counter() - t
    if not answer.get("ok"):
        raise SystemExit(f"{PROG}: submit refused: {answer.get('error')}")
    return took


def run(jobs: int) -> Dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-queue-"))
    conf = _setup(base)
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(base / "dev" / f"nvidia{i}")], stdout=subprocess.PIPE
        )
        for i in range(2)
    ]
    log = open(base / "daemon.log", "wb")  # noqa: SIM115
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpu_mon", "--config", str(conf), "--sim", str(base / "sim.json"), "run"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    sock = str(base / "run" / "queue.sock")
    try:
        for h in holders:
            assert h.stdout is not None and h.stdout.readline() == b"open\n"
        _wait(lambda: os.path.exists(sock), 30, "the queue's socket")
        times: List[float] = [_submit(sock, i) for i in range(jobs)]
        last = times[-min(1000, len(times)) :]
        t = time.perf_counter()
        listed = request(sock, {"op": "jobs"})["jobs"]
        jobs_request = time.perf_counter() - t
        t = time.perf_counter()
        cli = subprocess.run(
            [sys.executable, "-m", "gpu_mon", "--config", str(conf), "jobs", "--json"],
            cwd=ROOT,
            capture_output=True,
        )
        jobs_cli = time.perf_counter() - t
        if len(listed) != jobs or cli.returncode != 0:
            raise SystemExit(f"{PROG}: `jobs` listed {len(listed)} of {jobs}: {cli.stderr[-200:]!r}")
        return {
            "jobs": jobs,
            "submit_p50_ms": median(last) * 1000,
            "submit_p99_ms": percentile(last, 99) * 1000,
            "submit_max_ms": max(last) * 1000,
            "jobs_request_ms": jobs_request * 1000,
            "jobs_command_ms": jobs_cli * 1000,
        }
    except NoDaemon as err:
        raise SystemExit(f"{PROG}: {err}; see {base / 'daemon.log'}") from None
    finally:
        daemon.terminate()
        daemon.wait(30)
        for h in holders:
            h.kill()
            h.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print(f"{PROG}: run it as root (the daemon runs jobs as their users)", file=sys.stderr)
        return 2
    r = run(a.jobs)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{a.jobs} jobs queued; submit latency over the last 1000 submits, then `jobs` with all of them")
    print(
        table(
            ["submit p50", "submit p99", "submit max", "jobs (request)", "gpu-mon jobs --json"],
            [
                [
                    f"{r['submit_p50_ms']:.1f} ms",
                    f"{r['submit_p99_ms']:.1f} ms",
                    f"{r['submit_max_ms']:.1f} ms",
                    f"{r['jobs_request_ms']:.0f} ms",
                    f"{r['jobs_command_ms']:.0f} ms",
                ]
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
