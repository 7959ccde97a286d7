#!/usr/bin/env python3
"""Benchmark: the history's size and `gpu-mon report`'s speed over a long synthetic history.

    python bench/history_synth.py [--days 90] [--gpus 8]

Writes a history the way the daemon does (api/historydb.py's schema; a sample per GPU every 60 s, a state
change every 10-60 minutes per GPU, a workload run per harvesting stretch, a preemption when someone takes
a GPU from a workload, an idle-holder episode now and then) and times `gpu-mon report` on it: the default
table, --json, and --plot. Baseline in the same run: reading every row of every table once
(`SELECT *`), the least any report must do without indices.
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_mon.api import historydb

STATES = ("harvesting", "foreign", "idle", "paused", "unknown")
WEIGHTS = (0.55, 0.25, 0.12, 0.06, 0.02)
USERS = ("alice", "bob", "carol", "dave")


def make(path: str, days: float, gpus: int, seed: int = 1) -> None:
    """A synthetic history of `days` days ending now for `gpus` GPUs."""
    rnd = random.Random(seed)
    conn = historydb.connect_rw(path)
    end = time.time()
    start = end - days * 86400
    conn.execute("BEGIN")
    for g in range(gpus):
        uuid = f"GPU-synth-{g:04d}"
        conn.execute("INSERT OR REPLACE INTO gpus VALUES (?, ?, ?, ?)", (uuid, g, "Synthetic H100", end))
        _one_gpu(conn, rnd, uuid, start, end)
        conn.executemany(
            "INSERT INTO samples VALUES (?, ?, ?, ?)",
            ((t, uuid, rnd.randrange(0, 80000), rnd.randrange(0, 101)) for t in _every(start, end, 60)),
        )
    conn.execute("COMMIT")
    conn.close()


def _every(start: float, end: float, step: float):
    t = start
    while t < end:
        yield t
        t += step


def _one_gpu(conn: sqlite3.Connection, rnd: random.Random, uuid: str, start: float, end: float) -> None:
    t, prev = start, "idle"
    while t < end:
        state = rnd.choices(STATES, WEIGHTS)[0]
        length = min(end - t, rnd.uniform(600, 3600))
        user = rnd.choice(USERS) if state == "foreign" else ("nobody" if state == "harvesting" else "")
        conn.execute(
            "INSERT INTO intervals (uuid, state, detail, users, start, end) VALUES (?, ?, '', ?, ?, ?)",
            (uuid, state, user, t, t + length),
        )
        if state == "harvesting":
            conn.execute(
                "INSERT INTO runs (process, label, gpus, user, start, end, how) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ("miner", f"miner@{uuid[-1]}", uuid, "nobody", t, t + length, "stopped"),
            )
        if state == "foreign" and prev == "harvesting":
            conn.execute(
                "INSERT INTO preemptions (time, uuid, workload, who, detected_by, term_ms, gone_ms) "
                "VALUES (?, ?, 'miner', ?, 'open', ?, ?)",
                (t, uuid, user, rnd.uniform(5, 40), rnd.uniform(10, 80)),
            )
        if state == "foreign" and rnd.random() < 0.1:
            conn.execute(
                "INSERT INTO idle_holders (uuid, pid, user, program, memory_mib, start, end) "
                "VALUES (?, ?, ?, 'python3', 40000, ?, ?)",
                (uuid, rnd.randrange(1000, 60000), user, t, t + length),
            )
        prev, t = state, t + length


def timed(fn, repeat: int = 5) -> float:
    """Median wall seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def startup(env: dict) -> None:
    """Interpreter start and imports: the part of a report's time that is not the report."""
    subprocess.run([sys.executable, "-c", "import gpu_mon.cli"], check=True, env=env)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=90)
    ap.add_argument("--gpus", type=int, default=8)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-history-"))
    db = work / "history.sqlite"
    t = time.perf_counter()
    make(str(db), a.days, a.gpus)
    made = time.perf_counter() - t
    conf = work / "c.conf"
    conf.write_text(f"[history]\npath = {db}\n")
    os.chmod(conf, 0o600)
    size = db.stat().st_size / 1e6
    gpu_months = a.gpus * a.days / 30
    with sqlite3.connect(db) as c:
        counts = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("intervals", "samples")}
    base = [sys.executable, "-m", "gpu_mon", "--config", str(conf), "report", "--since", f"{a.days:g}d"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))

    def run(*extra: str) -> None:
        subprocess.run([*base, *extra], check=True, capture_output=True, env=env)

    def scan_all() -> None:
        with sqlite3.connect(db) as c:
            for table in ("intervals", "runs", "preemptions", "idle_holders", "samples"):
                c.execute(f"SELECT * FROM {table}").fetchall()

    rows = [
        ("gpu-mon report (table, whole command)", timed(run)),
        ("gpu-mon report --json", timed(lambda: run("--json"))),
        ("gpu-mon report --plot (PNG)", timed(lambda: run("--plot", str(work / "p.png")), repeat=3)),
        ("python -c 'import gpu_mon.cli' (start-up only)", timed(lambda: startup(env))),
        ("baseline: SELECT * of every table", timed(scan_all)),
    ]
    print(
        f"{a.days:g} days x {a.gpus} GPUs: {counts['intervals']} intervals, {counts['samples']} samples; "
        f"made in {made:.1f} s"
    )
    print(f"database: {size:.1f} MB = {size / gpu_months:.2f} MB per GPU-month (samples every 60 s)")
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  seconds (median)")
    for name, secs in rows:
        print(f"{name:<{width}}  {secs:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
