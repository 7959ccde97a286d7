#!/usr/bin/env python3
"""Benchmark: a plain user's brief probes of a queue job's GPU, and a newcomer who holds it (issue 46).

    sudo python bench/probes.py [--seconds 30] [--period 2.5] [--hold-ms 50] [--trials 10]
                                [--baseline 71478dc]

A real `gpu-mon run` on two simulated GPUs with a [queue] on GPU 0 (start delay 0.2 s) and a [process-*]
workload on GPU 1, as shipped otherwise (polls every 2 s). A job (root's, through the socket) runs on
GPU 0. Then:

- probes: a process of `nobody` opens GPU 0's node for --hold-ms every --period seconds for --seconds;
  counted: the job's stop signals in that time (stamped by its own handler) and its longest run;
- a newcomer: a process opens GPU 0's node and keeps it, --trials times (closed again once the job is
  stopped, and the job let start again): open -> the job's stop signal, p50 and max (the job's handler
  stamps CLOCK_MONOTONIC, system-wide; the opener stamps just before its open());
- the admin's workload: the same open of GPU 1's node, --trials times: open -> the workload's SIGTERM;
- a loop: `nobody` opens and closes GPU 0's node as fast as Python goes for --flood-seconds: the daemon's
  CPU (% of a core) and the job's stop signals meanwhile.

The same at --baseline (a git ref of this checkout, extracted with `git archive` and run the same way),
in the same run. Checks first what it needs (root, the user nobody, git and the ref) and says all of it
in one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import (  # noqa: E402
    median,
    percentile,
    queue_request,
    side_by_side,
    sim_gpus,
    start_daemon,
    table,
    wait_until,
)
from open_flood import FLOOD  # noqa: E402
from preempt import OPENER, WORKLOAD, baseline_problem, cpu_ticks  # noqa: E402

PROG = "bench/probes.py"
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # (nobody can run it)
# The queue's job: its start and its stop signal, stamped (CLOCK_MONOTONIC) by itself
JOB = r"""
import json, os, signal, sys, time
report = sys.argv[1]
def say(**kw):
    with open(report, "a") as f:
        f.write(json.dumps(kw) + "\n")
def on_term(*_):
    say(event="term", pid=os.getpid(), t=time.monotonic_ns())
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
say(event="start", pid=os.getpid(), t=time.monotonic_ns())
while True:
    time.sleep(3600)
"""
# Opens the node for `hold` seconds every `period` seconds until `seconds` have passed; says how many
PROBER = r"""
import os, sys, time
path, hold, period, seconds = sys.argv[1], *map(float, sys.argv[2:5])
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    began = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    time.sleep(hold)
    os.close(fd)
    n += 1
    time.sleep(max(0.0, period - (time.monotonic() - began)))
print(n, flush=True)
"""


def missing_prerequisites(a: argparse.Namespace) -> List[str]:
    """Everything the run needs and lacks, checked before anything starts."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (the daemon must see every process, the probes run as nobody: sudo)")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        out.append("needs the user nobody (the probes' plain user)")
    problem = baseline_problem(a.baseline)
    if problem:
        out.append(problem)
    return out


def _events(path: Path) -> List[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # (a line being written)
            continue
    return out


class Run:
    """One daemon (the code at `code`) with its job on GPU 0 and its workload on GPU 1."""

    def __init__(self, work: Path, code: Path):
        self.dir = work
        work.mkdir()
        os.chmod(work, 0o755)
        sim_gpus(work, 2)
        for node in (work / "dev").iterdir():
            os.chmod(node, 0o666)  # (as /dev/nvidiaN are)
        (work / "workload.py").write_text(WORKLOAD)
        (work / "job.py").write_text(JOB)
        self.job_report, self.workload_report = work / "job.jsonl", work / "workload.jsonl"
        self.socket = str(work / "run" / "queue.sock")
        conf = (
            "[defaults]\nstart_delay_seconds = 0.2\nstop_timeout_seconds = 5\n"
            f"state_file = {work}/state.json\n"
            f"[history]\nenabled = no\n[gpu-all]\ngpus = ALL\n"
            f"[process-bench]\nuser = root\ngpus = 1\ncmd = {sys.executable} {work}/workload.py "
            f"{self.workload_report}\n"
            f"[queue]\nsocket = {self.socket}\ndatabase = {work}/queue.sqlite\ngpus = 0\n"
            "start_delay_seconds = 0.2\nlauncher = direct\ngrace_seconds = 5\n"
        )
        self.daemon, self.log = start_daemon(work, conf, str(code))
        wait_until(lambda: os.path.exists(self.socket), 60, f"the queue's socket ({work}/daemon.log)", PROG)
        req = {
            "op": "submit",
            "command": [sys.executable, str(work / "job.py"), str(self.job_report)],
            "cwd": str(work),
            "env": {"PATH": "/usr/bin:/bin"},
            "output": str(work / "job.log"),
            "checked_as_user": True,
        }
        answer = queue_request(self.socket, req)
        if not answer.get("ok"):
            raise RuntimeError(f"submit refused: {answer.get('error')}")

    def starts(self, which: str = "job") -> List[dict]:
        path = self.job_report if which == "job" else self.workload_report
        return [e for e in _events(path) if e["event"] == "start"]

    def terms(self, which: str = "job") -> List[dict]:
        path = self.job_report if which == "job" else self.workload_report
        return [e for e in _events(path) if e["event"] == "term"]

    def running(self, which: str) -> dict:
        """Its run now (waiting for a start after the last stop)."""

        def now_running() -> Optional[dict]:
            starts = self.starts(which)
            return starts[-1] if starts and len(starts) > len(self.terms(which)) else None

        return wait_until(now_running, 30, f"the {which} running ({self.dir}/daemon.log)", PROG)

    def probes(self, seconds: float, period: float, hold: float) -> Dict[str, float]:
        """The probes of GPU 0 by nobody: how many, the job's stops meanwhile, its longest run in them."""
        self.running("job")
        time.sleep(1.0)  # (the job's start is not in the window)
        nobody = pwd.getpwnam("nobody")
        t0 = time.monotonic_ns()
        prober = subprocess.run(
            [PY, "-c", PROBER, str(self.dir / "dev" / "nvidia0"), str(hold), str(period), str(seconds)],
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            capture_output=True,
            text=True,
            check=True,
        )
        t1 = time.monotonic_ns()
        stops = [e["t"] for e in self.terms() if t0 <= e["t"] < t1]
        starts = [e["t"] for e in self.starts() if e["t"] < t1]
        edges = sorted([(t, "start") for t in starts] + [(t, "term") for t in stops])
        longest, began = 0.0, float(t0)
        for t, kind in edges:
            if kind == "start" and t > t0:
                began = t
            elif kind == "term":
                longest, began = max(longest, t - began), float("nan")
        if began == began:  # (not nan: it ran to the window's end)
            longest = max(longest, t1 - began)
        return {"probes": int(prober.stdout), "stops": len(stops), "longest": longest / 1e9}

    def opens(self, trials: int) -> Tuple[List[float], List[float]]:
        """ms from an open of the job's GPU to its stop signal, and of the workload's to its SIGTERM."""
        out: Dict[str, List[float]] = {"job": [], "workload": []}
        for _ in range(trials):
            for which, node in (("job", "nvidia0"), ("workload", "nvidia1")):
                self.running("job")  # (both: neither start's work weighs on the other's stop)
                self.running("workload")
                time.sleep(0.3)  # (settled: not the starts' rounds)
                out[which].append(self._open_to_stop(which, self.dir / "dev" / node))
        return out["job"], out["workload"]

    def _open_to_stop(self, which: str, node: Path) -> float:
        before = len(self.terms(which))
        opener = subprocess.Popen(
            [sys.executable, "-c", OPENER, str(node)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            opener.stdin.write("open\n")
            opener.stdin.flush()
            t_open = int(opener.stdout.readline())
            wait_until(lambda: len(self.terms(which)) > before, 30, f"the {which}'s stop signal", PROG)
            return (self.terms(which)[-1]["t"] - t_open) / 1e6
        finally:
            opener.kill()
            opener.wait()

    def flood(self, seconds: float) -> Tuple[float, int]:
        """nobody's open/close loop on GPU 0 for `seconds`: (the daemon's CPU %, the job's stops)."""
        self.running("job")
        time.sleep(1.0)  # (the start's rounds are not the loop's)
        nobody = pwd.getpwnam("nobody")
        before = len(self.terms())
        t0, ticks0 = time.monotonic(), cpu_ticks(self.daemon.pid)
        loop = subprocess.Popen(
            [PY, "-c", FLOOD, str(self.dir / "dev" / "nvidia0")],
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(seconds)
        t1, ticks1 = time.monotonic(), cpu_ticks(self.daemon.pid)
        loop.send_signal(signal.SIGTERM)
        loop.communicate(timeout=30)
        cpu = 100.0 * (ticks1 - ticks0) / os.sysconf("SC_CLK_TCK") / (t1 - t0)
        return cpu, len(self.terms()) - before

    def stop(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(60)
        self.log.close()


def measure(work: Path, code: Path, a: argparse.Namespace) -> list:
    """One version's row."""
    run = Run(work, code)
    try:
        probed = run.probes(a.seconds, a.period, a.hold_ms / 1000)
        job, workload = run.opens(a.trials)
        cpu, loop_stops = run.flood(a.flood_seconds)
    finally:
        run.stop()
    return [
        int(probed["probes"]),
        int(probed["stops"]),
        f"{probed['longest']:.1f}",
        f"{median(job):.0f} / {max(job):.0f}",
        f"{median(workload):.1f} / {percentile(workload, 99):.1f}",
        f"{cpu:.1f}",
        loop_stops,
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="how long the probes go on")
    ap.add_argument("--period", type=float, default=2.5, help="seconds from one probe to the next")
    ap.add_argument("--hold-ms", type=float, default=50.0, help="how long each probe holds the node")
    ap.add_argument("--trials", type=int, default=10, help="opens that hold, of each GPU")
    ap.add_argument("--flood-seconds", type=float, default=10.0, help="how long the open/close loop goes on")
    ap.add_argument("--baseline", default="71478dc", help="git ref to measure side by side ('' for none)")
    ap.add_argument("--keep", action="store_true", help="leave the daemons' directories (their logs)")
    a = ap.parse_args()
    if min(a.seconds, a.period, a.hold_ms, a.flood_seconds) <= 0 or a.trials < 1:
        ap.error("--seconds, --period, --hold-ms, --flood-seconds must be more than 0, --trials at least 1")
    missing = missing_prerequisites(a)
    if missing:
        print(f"{ap.prog}: cannot start: {'; '.join(missing)}", file=sys.stderr)
        return 2
    say = f"{a.seconds:g} s of probes, {a.trials} opens of each GPU, a loop..."
    errors = (RuntimeError, subprocess.CalledProcessError)
    rows = side_by_side(ap.prog, a, "gpu-mon-probes-", say, measure, errors)
    if rows is None:
        return 1
    print(
        f"\n{os.cpu_count()} CPUs; kernel {os.uname().release}; probes of {a.hold_ms:g} ms every "
        f"{a.period:g} s for {a.seconds:g} s by nobody on the job's GPU"
    )
    headers = ["version", "probes", "job stops", "longest run s", "hold -> job stop p50/max ms"]
    headers += ["open -> workload stop p50/p99 ms", "loop: daemon CPU %", "loop: job stops"]
    print(table(headers, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
