#!/usr/bin/env python3
"""How long the daemon takes to listen, and its RSS then, with a big queue database (issue 36, item 3).

    sudo .venv/bin/python bench/queue_start.py [--users 3] [--jobs 5000] [--env-kb 13] [--arrays 1]
                                               [--baseline 7c4bf7b]

Two databases, each built by the version measured (its own Store, through `submit`/`submit_array`, as its
daemon would store them): `at the caps`: --users users, each with --jobs finished jobs of an --env-kb KB
environment (5000 jobs of 13 KB: [queue] max_kept_per_user and max_stored_mib_per_user as shipped);
`array flood`: each user's --arrays cancelled 1000-element arrays with a 100 KB environment (the issue's
case). For this checkout, then for --baseline (a git ref, '' for none): database MB, seconds from start to
the queue's socket, and the daemon's RSS then.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import extract_ref, sim_gpus, start_daemon, table

ROOT = Path(__file__).resolve().parents[1]
PROG = "bench/queue_start.py"
# Run by the version measured: argv db users jobs env_kb arrays
BUILD = r"""
import sys, time
from gpu_mon.queue import jobs as J
from gpu_mon.queue.store import Store
db = sys.argv[1]
users, jobs, env_kb, arrays = (int(x) for x in sys.argv[2:6])
store = Store.open(db, time.time())
store.conn.execute("PRAGMA synchronous=OFF")  # (building only)
now = time.time()
for u in range(users):
    name = f"user{u}"
    def job(kb):
        env = tuple((f"V{i}", "x" * 1000) for i in range(kb))
        return J.Job(id=0, user=name, uid=5000 + u, gid=5000 + u, command=("true",), cwd="/", env=env,
                     output="", submitted=now, state=J.CANCELLED, ended=now, reason="cancelled")
    for _ in range(jobs):
        store.submit(job(env_kb), 10**9)
    for _ in range(arrays):
        store.submit_array(job(100), range(1000), 10**9)
store.close()
"""


def measure(work: Path, code: Path, a: argparse.Namespace, jobs: int, arrays: int) -> list:
    work.mkdir()
    os.chmod(work, 0o755)
    db = work / "queue.sqlite"
    env = dict(os.environ, PYTHONPATH=str(code))
    argv = [sys.executable, "-c", BUILD, str(db), str(a.users), str(jobs), str(a.env_kb), str(arrays)]
    subprocess.run(argv, check=True, env=env, cwd=str(work))
    size = sum(p.stat().st_size for p in work.glob("queue.sqlite*")) / 1e6
    sim_gpus(work)
    sock = work / "queue.sock"
    conf = (
        f"[defaults]\nstate_file = {work / 'state.json'}\n[history]\nenabled = no\n[gpu-all]\ngpus = ALL\n"
        f"[queue]\nsocket = {sock}\ndatabase = {db}\nlauncher = direct\n"
    )
    t0 = time.monotonic()
    daemon, log = start_daemon(work, conf, str(code))
    try:
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > t0 + 300:
                raise SystemExit(f"{PROG}: no queue socket; see {work / 'daemon.log'}")
            time.sleep(0.01)
        took = time.monotonic() - t0
        rss = _rss_mb(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()
    return [f"{size:.1f}", f"{took:.2f}", f"{rss:.0f}"]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[1])
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=5000, help="finished jobs per user (default 5000)")
    ap.add_argument("--env-kb", type=int, default=13, help="KB of each job's environment (default 13)")
    ap.add_argument("--arrays", type=int, default=1, help="1000-element arrays per user (default 1)")
    ap.add_argument("--baseline", default="7c4bf7b", help="git ref to measure too ('' for none)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-mon-bench-start-") as tmp:
        versions = [("this checkout", ROOT)]
        if a.baseline:
            versions.append((f"baseline {a.baseline}", extract_ref(ROOT, a.baseline, Path(tmp) / "base")))
        for name, code in versions:
            for case, jobs, arrays in (("at the caps", a.jobs, 0), ("array flood", 0, a.arrays)):
                work = Path(tmp) / f"{name.split()[0]}-{case.split()[0]}"
                rows.append([name, case, *measure(work, code, a, jobs, arrays)])
    what = f"{a.users} users: {a.jobs} jobs of {a.env_kb} KB each / {a.arrays} array(s) of 1000 x 100 KB each"
    print(what)
    print(table(["version", "database", "MB", "s to listen", "RSS MB"], rows))


if __name__ == "__main__":
    main()
