#!/usr/bin/env python3
"""Benchmark: a plain user opening and closing an idle GPU's node as fast as it can (issue 46, item 3).

    sudo python bench/open_flood.py [--seconds 20] [--trials 10] [--baseline 71478dc]

A real `gpu-mon run` on two simulated GPUs, [history] on: GPU 0 has nothing of gpu-mon's on it, GPU 1 runs
a workload. A process of `nobody` opens and closes GPU 0's node in a loop for --seconds; meanwhile the
daemon's CPU use (the whole process, and its main thread), the lines it logs and the history rows it writes
(rows that begin in the flood's window, counted once the daemon has stopped and flushed) are measured. Then,
the flood still going, a foreign process opens GPU 1's node --trials times: open -> the workload's SIGTERM
(stamped by its own handler), as bench/preempt.py measures it. The same at --baseline (a git ref of this
checkout, extracted with `git archive` and run side by side), in the same run.

Checks first what it needs (root, the user nobody, git and the ref) and says all of it in one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import median, percentile, side_by_side, sim_gpus, start_daemon, table  # noqa: E402
from preempt import OPENER, WORKLOAD, baseline_problem, cpu_ticks  # noqa: E402

# As fast as Python goes: one open and one close a turn; prints how many when told to stop (SIGTERM).
FLOOD = r"""
import os, signal, sys
n = 0
def done(*_):
    print(n, flush=True)
    os._exit(0)
signal.signal(signal.SIGTERM, done)
path = sys.argv[1]
while True:
    os.close(os.open(path, os.O_RDONLY))
    n += 1
"""
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # (nobody can run it)
# Rows of the history that begin (or happen) at a time: table -> its time column
HISTORY_TIMES = {
    "intervals": "start",
    "runs": "start",
    "preemptions": "time",
    "idle_holders": "start",
    "samples": "time",
}


def missing_prerequisites(a: argparse.Namespace) -> List[str]:
    """Everything the run needs and lacks, checked before anything starts."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (the daemon must see every process, the flood runs as nobody: sudo)")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        out.append("needs the user nobody (the flood's plain user)")
    problem = baseline_problem(a.baseline)
    if problem:
        out.append(problem)
    return out


class Flood:
    """One daemon (at `code`) under the flood, and what it cost."""

    def __init__(self, work: Path, code: Path):
        self.dir = work
        work.mkdir()
        os.chmod(work, 0o755)
        sim_gpus(work, 2)
        for node in (work / "dev").iterdir():
            os.chmod(node, 0o666)  # (as /dev/nvidiaN are)
        (work / "workload.py").write_text(WORKLOAD)
        self.report = work / "report.jsonl"
        cmd = f"{sys.executable} {work}/workload.py {self.report}"
        conf = (
            "[defaults]\nstart_delay_seconds = 0.2\nstop_timeout_seconds = 5\n"
            f"state_file = {work}/state.json\n[gpu-all]\ngpus = ALL\n"
            f"[process-bench]\nuser = root\ngpus = 1\ncmd = {cmd}\n"
            f"[history]\nenabled = yes\npath = {work}/history.sqlite\n"
        )
        self.daemon, self.log = start_daemon(work, conf, str(code))
        self.flooder: Optional[subprocess.Popen] = None
        self.seen = 0
        self.running: dict = {}  # the workload's start that the flood began under
        self.flood_began = 0.0
        self.window = (0.0, 0.0)  # wall times of the measured part of the flood

    def events(self, kind: str) -> List[dict]:
        import json

        try:
            lines = self.report.read_text().splitlines()
        except OSError:
            return []
        return [e for e in (json.loads(x) for x in lines if x.strip()) if e["event"] == kind]

    def wait_start(self, timeout: float = 30.0) -> dict:
        """The workload's next start (a new one since the last asked)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            starts = self.events("start")
            if len(starts) > self.seen:
                self.seen = len(starts)
                return starts[-1]
            time.sleep(0.01)
        raise RuntimeError(f"the workload did not start (see {self.dir}/daemon.log)")

    def flood(self, seconds: float) -> Dict[str, float]:
        """Start the flood, measure for `seconds`: CPU %, main thread's CPU %, log lines, opens a second."""
        self.running = self.wait_start()
        time.sleep(1.0)  # (the start's lines and rows are not the flood's)
        node = str(self.dir / "dev" / "nvidia0")
        nobody = pwd.getpwnam("nobody")
        log_before, wall0 = self._log_lines(), time.time()
        ticks0, main0, t0 = cpu_ticks(self.daemon.pid), self._main_ticks(), time.monotonic()
        self.flooder = subprocess.Popen(
            [PY, "-c", FLOOD, node],
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.flood_began = time.monotonic()
        time.sleep(seconds)
        ticks1, main1, t1 = cpu_ticks(self.daemon.pid), self._main_ticks(), time.monotonic()
        tick = os.sysconf("SC_CLK_TCK")
        self.window = (wall0, time.time())
        return {
            "cpu": 100.0 * (ticks1 - ticks0) / tick / (t1 - t0),
            "main": 100.0 * (main1 - main0) / tick / (t1 - t0),
            "lines": self._log_lines() - log_before,
        }

    def _main_ticks(self) -> int:
        pid = self.daemon.pid
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    def _log_lines(self) -> int:
        return (self.dir / "daemon.log").read_bytes().count(b"\n")

    def yields(self, trials: int) -> List[float]:
        """ms from a foreign open of GPU 1's node to the workload's SIGTERM, `trials` times."""
        opener = subprocess.Popen(
            [sys.executable, "-c", OPENER, str(self.dir / "dev" / "nvidia1")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        out = []
        try:
            for i in range(trials):
                start = self.running if i == 0 else self.wait_start()
                time.sleep(0.3)
                opener.stdin.write("open\n")
                opener.stdin.flush()
                t_open = int(opener.stdout.readline())
                term = _wait_term(self, start["pid"])
                out.append((term - t_open) / 1e6)
                opener.stdin.write("close\n")
                opener.stdin.flush()
                opener.stdout.readline()
        finally:
            opener.kill()
            opener.wait()
        return out

    def stop(self) -> Tuple[float, int]:
        """Stop the flood and the daemon; (the flood's opens a second, history rows that began in the
        measured window)."""
        opens = 0.0
        if self.flooder is not None:
            self.flooder.send_signal(signal.SIGTERM)
            took = time.monotonic() - self.flood_began
            with contextlib.suppress(ValueError):
                opens = int(self.flooder.communicate(timeout=30)[0].strip() or 0) / took
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(60)
        self.log.close()
        return opens, self._rows()

    def _rows(self) -> int:
        since, until = self.window
        with contextlib.closing(sqlite3.connect(self.dir / "history.sqlite")) as db:
            return sum(
                db.execute(f"SELECT count(*) FROM {t} WHERE {c} >= ? AND {c} < ?", (since, until)).fetchone()[
                    0
                ]
                for t, c in HISTORY_TIMES.items()
            )


def _wait_term(run: Flood, pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        terms = [e for e in run.events("term") if e["pid"] == pid]
        if terms:
            return int(terms[-1]["t"])
        time.sleep(0.002)
    raise RuntimeError(f"the workload was not stopped within {timeout:g} s (see {run.dir}/daemon.log)")


def measure(work: Path, code: Path, a: argparse.Namespace) -> list:
    """One version's row."""
    run = Flood(work, code)
    try:
        found = run.flood(a.seconds)
        yields = run.yields(a.trials)
    finally:
        opens, rows = run.stop()
    return [
        f"{found['cpu']:.1f}",
        f"{found['main']:.1f}",
        f"{opens / 1000:.0f}k",
        int(found["lines"]),
        rows,
        f"{median(yields):.1f} / {percentile(yields, 99):.1f}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the flood is measured")
    ap.add_argument("--trials", type=int, default=10, help="foreign opens of GPU 1 after the window")
    ap.add_argument("--baseline", default="71478dc", help="git ref to measure side by side ('' for none)")
    ap.add_argument("--keep", action="store_true", help="leave the daemons' directories (their logs)")
    a = ap.parse_args()
    if a.seconds <= 0 or a.trials < 1:
        ap.error("--seconds must be more than 0, --trials at least 1")
    missing = missing_prerequisites(a)
    if missing:
        print(f"{ap.prog}: cannot start: {'; '.join(missing)}", file=sys.stderr)
        return 2
    say = f"{a.seconds:g} s of flood, then {a.trials} yields..."
    rows = side_by_side(ap.prog, a, "gpu-mon-flood-", say, measure)
    if rows is None:
        return 1
    print(
        f"\n{os.cpu_count()} CPUs; kernel {os.uname().release}; flood of {a.seconds:g} s by nobody on GPU 0"
    )
    headers = ["version", "daemon CPU %", "main thread %", "opens/s", "log lines", "history rows"]
    print(table([*headers, "yield on GPU 1 p50 / p99 ms"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
