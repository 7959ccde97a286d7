#!/usr/bin/env python3
"""Benchmark: how fast gpu-mon yields a GPU, and what it costs when nothing happens.

    sudo python bench/preempt.py [--procs 1000[,5000...]] [--trials 50] [--idle-seconds 60]

With N background processes (each holding ~10 fds), a real `gpu-mon run` on a simulated GPU runs a workload
(a process and its child). A foreign process (long-lived, like a Jupyter kernel) opens the GPU's node; we
measure the time from just before its open() to the workload receiving SIGTERM (stamped by the workload's
own handler, CLOCK_MONOTONIC is system-wide) and to the whole process group being gone (pidfds). The
foreign process then closes the node and the workload restarts for the next trial.

Modes, in the same run: gpu-mon as shipped (inotify IN_OPEN + incremental scan, polling every 2 s, a full
scan every 60 s, [history] recording), the same with history off, the same with [metrics] on (endpoint and
textfile) and scraped 20 times a second throughout, the same at an older version (--baseline REF, a git
ref of this checkout: the baseline measured side by side), and polling only, as the original gpu_mon does
(every 1 s with a full scan, no events). With --jobs N, also the shipped mode with a [queue] of N jobs
that cannot start (they wait for a second simulated GPU that a long-lived foreign process keeps busy); with
--array N, the same with one N-element array queued there by one submit (`submit --array 0-(N-1)`). The
shipped mode's row, in the same run, is the figure without them.
Then each daemon's CPU use over --idle-seconds of quiet, with the workload running. With several counts of
background processes (--procs 1000,5000), every mode runs at each count, and the table gets a column for it.

Before it starts anything it checks what it needs (root, Linux pidfds, the Python modules the daemons
import, the metrics extra, git and the baseline ref) and, if something is missing, says all of it in one
line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import (  # noqa: E402
    Background,
    extract_ref,
    free_port,
    median,
    percentile,
    queue_request,
    start_daemon,
    table,
)

WORKLOAD = r"""
import json, os, signal, sys, time
report = sys.argv[1]
def say(**kw):
    with open(report, "a") as f:
        f.write(json.dumps(kw) + "\n")
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        time.sleep(3600)
def on_term(*_):
    say(event="term", pid=os.getpid(), t=time.monotonic_ns())
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
say(event="start", pid=os.getpid(), child=child)
while True:
    time.sleep(3600)
"""

OPENER = r"""
import os, sys, time
for line in sys.stdin:
    if line.strip() == "open":
        t = time.monotonic_ns()
        fd = os.open(sys.argv[1], os.O_RDONLY)
        print(t, flush=True)
    else:
        os.close(fd)
        print("closed", flush=True)
"""


# What the daemons import (the metrics mode's [metrics] needs prometheus_client): name -> how to get it.
MODULES = {
    "psutil": "pip install psutil",
    "sdnotify": "pip install sdnotify",
    "prometheus_client": "pip install '.[metrics]'",
}


def missing_modules() -> List[str]:
    """The modules this Python (which also runs the daemons) cannot import, with how to get each."""
    out = []
    for name, fix in MODULES.items():
        try:
            importlib.import_module(name)
        except ImportError:
            out.append(f"needs the Python module {name} ({fix})")
    return out


def baseline_problem(ref: str) -> Optional[str]:
    """Why the baseline cannot be extracted, or None."""
    if not ref:
        return None
    if shutil.which("git") is None:
        return "needs git for --baseline (or pass --baseline '' to skip the baseline)"
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode != 0:
        return f"--baseline {ref} is not a commit of this checkout (or pass --baseline '' to skip it)"
    return None


def missing_prerequisites(a: argparse.Namespace) -> List[str]:
    """Everything the run needs and lacks, checked before anything starts."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (the daemon must see every process: sudo)")
    if not hasattr(os, "pidfd_open"):
        out.append("needs os.pidfd_open (Linux 5.3 or later, Python 3.9 or later)")
    out += missing_modules()
    problem = baseline_problem(a.baseline)
    if problem:
        out.append(problem)
    return out


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


class Run:
    """One daemon under test with its workload, simulated GPU and foreign opener."""

    def __init__(
        self,
        work: Path,
        name: str,
        defaults: Dict[str, object],
        code: Path = ROOT,
        history: object = None,
        metrics_port: int = 0,
        jobs: int = 0,
        array: int = 0,
    ):
        self.dir = work / name
        self.dir.mkdir()
        (self.dir / "dev").mkdir()
        self.device = self.dir / "dev" / "nvidia0"
        self.device.touch()
        gpus = [{"uuid": "GPU-bench-0", "device": "dev/nvidia0"}]
        queued = jobs or array
        if queued:  # a second GPU, kept busy by someone else: the queue's, where no job can start
            (self.dir / "dev" / "nvidia1").touch()
            gpus.append({"uuid": "GPU-bench-1", "device": "dev/nvidia1"})
        (self.dir / "sim.json").write_text(json.dumps({"gpus": gpus}))
        (self.dir / "workload.py").write_text(WORKLOAD)
        self.report = self.dir / "report.jsonl"
        values = {
            "start_delay_seconds": 0.2,
            "stop_timeout_seconds": 5,
            "state_file": str(self.dir / "state.json"),
        }
        values.update(defaults)
        conf = "[defaults]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
        conf += (
            f"[gpu-all]\ngpus = ALL\n[process-bench]\nuser = root\n"
            f"cmd = {sys.executable} {self.dir / 'workload.py'} {self.report}\n"
        )
        if history is not None:  # (a baseline older than [history] knows no such section)
            conf += (
                f"[history]\nenabled = {'yes' if history else 'no'}\npath = {self.dir / 'history.sqlite'}\n"
            )
        if metrics_port:
            conf += f"[metrics]\nlisten = {metrics_port}\ntextfile = {self.dir / 'gpu_mon.prom'}\n"
        self.busy = None
        if queued:
            conf = conf.replace("[process-bench]\n", "[process-bench]\ngpus = 0\n")
            conf += (
                f"[queue]\nsocket = {self.dir / 'queue.sock'}\ndatabase = {self.dir / 'queue.sqlite'}\n"
                f"gpus = 1\nmax_queued_per_user = {queued + 1}\n"
            )
            if array:  # (every index is below max_array_size)
                conf += f"max_array_size = {array}\n"
            self.busy = subprocess.Popen(  # long-lived, like a notebook's kernel
                [sys.executable, "-c", OPENER, str(self.dir / "dev" / "nvidia1")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            self.busy.stdin.write("open\n")
            self.busy.stdin.flush()
            self.busy.stdout.readline()
        self.daemon, self.log = start_daemon(self.dir, conf, str(code))
        if jobs:
            self.queue_jobs(jobs)
        if array:
            self.queue_array(array)
        self.opener = subprocess.Popen(
            [sys.executable, "-c", OPENER, str(self.device)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.seen = 0

    def queue_socket(self) -> str:
        """The queue's socket, once the daemon listens on it."""
        sock = str(self.dir / "queue.sock")
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise RuntimeError(f"no queue socket; the daemon's last line: {self.last_log_line()}")
            time.sleep(0.05)
        return sock

    def queue_jobs(self, count: int) -> None:
        """`count` jobs queued (as `gpu-mon submit` sends them), all waiting for the busy GPU."""
        sock = self.queue_socket()
        for i in range(count):
            req = {"op": "submit", "command": ["true", str(i)], "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}}
            if not queue_request(sock, req).get("ok"):
                raise RuntimeError(f"a submit was refused; the daemon's last line: {self.last_log_line()}")

    def queue_array(self, count: int) -> None:
        """One array of `count` elements queued by one submit (as `gpu-mon submit --array 0-N` sends it),
        every element waiting for the busy GPU."""
        req = {
            "op": "submit",
            "command": ["true"],
            "cwd": "/",
            "env": {"PATH": "/usr/bin:/bin"},
            "array": f"0-{count - 1}",
        }
        answer = queue_request(self.queue_socket(), req, timeout=60.0)
        if answer.get("elements") != count:
            raise RuntimeError(f"the array was refused ({answer.get('error')}); {self.last_log_line()}")

    def events(self) -> List[dict]:
        try:
            return [json.loads(x) for x in self.report.read_text().splitlines() if x.strip()]
        except (OSError, ValueError):
            return []

    def wait_start(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            starts = [e for e in self.events() if e["event"] == "start"]
            if len(starts) > self.seen:
                self.seen = len(starts)
                return starts[-1]
            time.sleep(0.01)
        raise RuntimeError(f"workload did not start; the daemon's last line: {self.last_log_line()}")

    def last_log_line(self) -> str:
        try:
            lines = (self.dir / "daemon.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return next((x.strip() for x in reversed(lines) if x.strip()), "(empty log)")

    def trial(self) -> Tuple[float, float]:
        """One preemption: (ms open->SIGTERM, ms open->group gone)."""
        start = self.wait_start()
        fds = [os.pidfd_open(start["pid"]), os.pidfd_open(start["child"])]
        time.sleep(0.3)  # let the daemon settle into its quiet state (the open must come out of the blue)
        self.opener.stdin.write("open\n")
        self.opener.stdin.flush()
        t_open = int(self.opener.stdout.readline())
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        remaining = set(fds)
        deadline = time.monotonic() + 30
        while remaining and time.monotonic() < deadline:
            for fd, _ in poller.poll(100):
                remaining.discard(fd)
                poller.unregister(fd)
        t_gone = time.monotonic_ns()
        for fd in fds:
            os.close(fd)
        if remaining:
            raise RuntimeError("workload not stopped within 30 s")
        terms = [e for e in self.events() if e["event"] == "term" and e["pid"] == start["pid"]]
        t_term = terms[-1]["t"] if terms else t_gone
        self.opener.stdin.write("close\n")
        self.opener.stdin.flush()
        assert self.opener.stdout.readline().strip() == "closed"
        return (t_term - t_open) / 1e6, (t_gone - t_open) / 1e6

    def idle_cpu(self, seconds: float) -> float:
        """Percent of one core the daemon used over `seconds` of quiet (workload running)."""
        self.wait_start()
        time.sleep(1.0)
        tick = os.sysconf("SC_CLK_TCK")
        before, t0 = cpu_ticks(self.daemon.pid), time.monotonic()
        time.sleep(seconds)
        after, t1 = cpu_ticks(self.daemon.pid), time.monotonic()
        return 100.0 * (after - before) / tick / (t1 - t0)

    def close(self) -> None:
        self.opener.kill()
        self.opener.wait()
        if self.busy is not None:
            self.busy.kill()
            self.busy.wait()
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(30)
        self.log.close()


class Scraper:
    """GET /metrics 20 times a second in a thread, as an impatient Prometheus would."""

    def __init__(self, port: int):
        self.port, self.done = port, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.wait(0.05):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read()

    def close(self) -> None:
        self.done.set()
        self.thread.join(10)


def counts(text: str) -> Tuple[int, ...]:
    """--procs: a number, or numbers separated by commas (each a row of every mode)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or numbers separated by commas: {text!r}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=counts, default=(1000,), help="background processes (1000,5000: each)")
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--idle-seconds", type=float, default=60.0)
    ap.add_argument("--baseline", default="87addb5", help="git ref to measure side by side ('' for none)")
    ap.add_argument("--jobs", type=int, default=0, help="also with a [queue] of N jobs waiting (0: not)")
    ap.add_argument(
        "--array", type=int, default=0, metavar="N", help="also with one N-element array queued (0: not)"
    )
    a = ap.parse_args()
    if a.trials < 1 or min(a.procs) < 0 or a.idle_seconds <= 0 or a.jobs < 0 or a.array < 0:
        ap.error(
            "--trials must be at least 1, --procs, --jobs and --array at least 0, --idle-seconds more than 0"
        )
    missing = missing_prerequisites(a)
    if missing:
        print(f"{ap.prog}: cannot start: {'; '.join(missing)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-preempt-"))
    modes = [
        ("gpu-mon as shipped (inotify + incremental scan, poll 2 s; history on)", "events", {}, ROOT, True),
        ("the same with history off", "nohistory", {}, ROOT, False),
        *(
            [(f"the same with {a.jobs} jobs queued (on a second GPU kept busy)", "jobs", {}, ROOT, True)]
            if a.jobs
            else []
        ),
        *(
            [(f"the same with one {a.array}-element array queued (on the busy GPU)", "array", {}, ROOT, True)]
            if a.array
            else []
        ),
        ("the same, history and [metrics] on, scraped 20 times a second", "metrics", {}, ROOT, True),
    ]
    if a.baseline:
        old = extract_ref(ROOT, a.baseline, work / "baseline-code")
        # As shipped at that version: history on, in the run's directory (never the machine's own file);
        # a version older than [history] gets no such section.
        config = Path(old) / "gpu_mon" / "config"  # (a module, later a package)
        files = [config.with_suffix(".py")] if config.with_suffix(".py").exists() else config.glob("*.py")
        knows = any('"history"' in f.read_text(errors="replace") for f in files)
        modes.append((f"the same at {a.baseline} (baseline)", "baseline", {}, old, True if knows else None))
    modes += [
        (
            "polling only, as the original gpu_mon (1 s, full scan, no events)",
            "polling",
            {"interval_seconds": 1, "watch_opens": "no", "full_scan_seconds": 1},
            ROOT,
            False,
        ),
    ]
    bgs: List[Background] = []
    rows: List[list] = []
    nprocs = []
    try:
        for count in a.procs:
            more = max(0, count - sum(len(b.procs) for b in bgs))
            print(f"starting {more} more background processes ({count} in all)...", flush=True)
            bgs.append(Background(more))
            nprocs.append(sum(1 for n in os.listdir("/proc") if n.isdigit()))
            (work / f"procs-{count}").mkdir()
            found = run_modes(ap.prog, a, work / f"procs-{count}", modes)
            if found is None:
                return 1
            rows += [[count, *row] if len(a.procs) > 1 else row for row in found]
    finally:
        for bg in bgs:
            bg.close()
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{' / '.join(map(str, nprocs))} processes in /proc; {os.cpu_count()} CPUs; "
        f"kernel {os.uname().release}; idle CPU over {a.idle_seconds:g} s"
    )
    print(
        table(
            [
                *(["background processes"] if len(a.procs) > 1 else []),
                "mode",
                "trials",
                "open->SIGTERM p50 ms",
                "p99 ms",
                "max ms",
                "open->group gone p50 ms",
                "p99 ms",
                "idle CPU % of a core",
            ],
            rows,
        )
    )
    return 0


def run_modes(prog: str, a: argparse.Namespace, work: Path, modes: list) -> Optional[List[list]]:
    """Every mode with the background processes that run now: a row each (None when one failed)."""
    rows = []
    for label, name, defaults, code, history in modes:
        port = free_port() if name == "metrics" else 0
        jobs, array = (a.jobs if name == "jobs" else 0), (a.array if name == "array" else 0)
        run = Run(work, name, defaults, code, history, port, jobs, array)
        scraper = Scraper(port) if port else None
        try:
            samples = []
            for i in range(a.trials):
                samples.append(run.trial())
                if (i + 1) % 10 == 0:
                    print(f"  {name}: {i + 1}/{a.trials} trials", flush=True)
            cpu = run.idle_cpu(a.idle_seconds)
        except RuntimeError as e:
            print(f"{prog}: {name}: {e}", file=sys.stderr)
            return None
        finally:
            if scraper is not None:
                scraper.close()
            run.close()
        term = [s[0] for s in samples]
        gone = [s[1] for s in samples]
        rows.append(
            [
                label,
                len(samples),
                f"{median(term):.1f}",
                f"{percentile(term, 99):.1f}",
                f"{max(term):.1f}",
                f"{median(gone):.1f}",
                f"{percentile(gone, 99):.1f}",
                f"{cpu:.2f}",
            ]
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
