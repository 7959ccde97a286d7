#!/usr/bin/env python3
"""Benchmark: the queue with 10 000 jobs queued, measured side by side with an older version.

    sudo python bench/queue.py [--jobs 10000] [--baseline REF] [--trials 5] [--hostile 1000]
                               [--arrays 10000] [--array-count 5] [--idle-seconds 30]

For this checkout and for --baseline (a git ref of this checkout, extracted and run the same way; '' for
none), a real `gpu-mon run` (root) with a [queue] on two simulated GPUs that someone else holds; both
daemons run at once and every measurement is taken of each in turn (one submit to each, one command of
each...), so that other work on the machine weighs on both alike. We submit
--jobs jobs through the socket as `gpu-mon submit` does (one connection, one request, the answer: the job
is committed to SQLite with synchronous=FULL first), each `--after` a held job, so that all stay queued
and the placement goes over every one of them each time. Measured:

- submit -> id, p50 and p99: over the first 200 submits (about 0 queued) and the last 1000 (--jobs queued);
- `gpu-mon jobs` and `gpu-mon jobs --json`, the whole command as a user types it (Python's start, the
  request, the printing), median of 5 after one warm-up run; each command typed is the version's own
  `gpu-mon` as pip installs it (its bin/gpu-mon, or the console script pip writes for an older version's
  entry point), on this Python in a virtualenv with nothing installed, the version's code on PYTHONPATH
  (as installed: no editable install's import hook, no `python -m`);
- a job's start after its GPU frees: from the foreign holder's close() of GPU 0's node to the job's first
  action (it opens a FIFO we wait on), less the start delay; also in rounds (interval_seconds);
- `gpu-mon submit --hold -- true`, the whole command as a user types it (Python's start, the imports, the
  check as the user, the request), p50 and p99 of 21;
- the daemon's CPU seconds (user and system, /proc/PID/stat) to take the --jobs submits, and its idle CPU
  over --idle-seconds afterwards with them queued (nothing asked of it), in % of one core;
- arrays (--arrays N), each version on a fresh daemon: --array-count held `submit --hold --array
  0-(N-1)` one after the other (submit -> id, p50 and max), the daemon's VmRSS before and after them,
  `gpu-mon jobs` with them queued; beside the N single submits a user's shell loop makes (the sum of the
  submits above, in each version);
- submit p99 (500 submits) with --hostile connections of another user (nobody) held open at once (each
  reopened when the daemon closes it: silent clients), and oversized frames, against the p99 just before
  without them.

Prints a table (the machine and date above it); --json for the numbers.
"""

from __future__ import annotations

import sys

if __name__ == "queue":
    # Found as `queue` because bench/ is on some process's sys.path: be the standard library's queue.
    import importlib
    import os

    _here = os.path.dirname(os.path.realpath(__file__))
    _saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]
    del sys.modules["queue"]
    try:
        sys.modules["queue"] = importlib.import_module("queue")
    finally:
        sys.path[:] = _saved
else:
    # Run as a script, bench/ is first on sys.path: any later `import queue` of the standard library
    # (logging.handlers, concurrent.futures...) would find this file. The sibling modules load by path.
    import os

    _here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]

import argparse
import importlib.util
import json
import pwd
import re
import resource
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Union

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROG = "bench/queue.py"
DEFAULT_BASELINE = "7c4bf7b"  # the queue as issue 38 measured it beside Slurm
INTERVAL = 2.0  # [defaults] interval_seconds, as shipped

HOLDER = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        t = time.monotonic_ns()
        os.close(fd)
        print(t, flush=True)
    else:
        fd = os.open(sys.argv[1], os.O_RDONLY)
        print("open", flush=True)
"""

# Another user's hostile clients: COUNT connections that say nothing (reopened when the daemon closes
# them: past the daemon's limit on one user's connections, at once), and a frame far over the limit.
HOSTILE = r"""
import os, resource, select, socket, struct, sys, time
path, count = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s
conns = {}
poller = select.poll()
def add():
    s = connect()
    conns[s.fileno()] = s
    poller.register(s, select.POLLIN)
for _ in range(count):
    add()
print("ready", flush=True)
while True:
    for fd, _ in poller.poll(100):  # closed by the daemon (silent too long): connect again
        poller.unregister(fd)
        conns.pop(fd).close()
        add()
    big = connect()
    try:  # (a daemon that counts each user's connections refuses and closes it first)
        big.sendall(struct.pack(">I", 1 << 30) + b"x" * 65536)
    except OSError:
        pass
    big.close()
"""


def _sibling(name: str):
    """bench/NAME.py, loaded by its path (bench/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"gpu_mon_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bg = _sibling("background")


def typed_gpu_mon(work: Path, code: Path) -> str:
    """`gpu-mon` as pip installs it, on this Python in a virtualenv of its own with nothing installed,
    `code` then on PYTHONPATH: the version's own bin/gpu-mon with its first line made the virtualenv's
    Python (as pip does), or, for a version with an entry point instead, the console script pip writes for
    it. The commands typed are timed as an installed gpu-mon runs, not through this checkout's editable
    install, whose import hook alone costs ~15 ms at every start, nor through `python -m` (runpy)."""
    venv = work / "bare-venv"
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    script = venv / "bin" / f"gpu-mon-{code.name}"
    own = code / "bin" / "gpu-mon"
    if own.exists():
        first, rest = own.read_text().split("\n", 1)
        if first != "#!python":
            raise SystemExit(f"{PROG}: {own} does not begin with #!python")
        script.write_text(f"#!{venv}/bin/python\n{rest}")
    else:
        entry = re.search(r"^\s*gpu-mon\s*=\s*([\w.]+):(\w+)", (code / "setup.cfg").read_text(), re.M)
        if entry is None:
            raise SystemExit(f"{PROG}: {code} has neither bin/gpu-mon nor a gpu-mon console script")
        script.write_text(
            f"#!{venv}/bin/python\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
            f"from {entry.group(1)} import {entry.group(2)}\nif __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
            f"    sys.exit({entry.group(2)}())\n"
        )
    script.chmod(0o755)
    return str(script)


def ask(path: str, obj: dict) -> dict:
    """One request on the queue's socket (either version's)."""
    try:
        return bg.queue_request(path, obj)
    except ConnectionError as err:
        raise SystemExit(f"{PROG}: {err}") from None


def _wait(cond, timeout: float, what: str):
    return bg.wait_until(cond, timeout, what, PROG)


def pct(values: List[float], p: float) -> float:
    return bg.percentile(values, p) if values else float("nan")


class Run:
    """One daemon under test (this checkout or the baseline) with its two held GPUs."""

    def __init__(self, work: Path, name: str, code: Path, start_delay: float):
        self.dir = work / name
        self.dir.mkdir()
        self.code, self.delay = code, start_delay
        bg.sim_gpus(self.dir)
        self.socket = str(self.dir / "run" / "queue.sock")
        self.conf = self.dir / "gpu_mon.conf"
        conf = (
            f"[defaults]\nstate_file = {self.dir / 'state.json'}\ninterval_seconds = {INTERVAL:g}\n"
            f"[history]\nenabled = no\n[gpu-all]\ngpus = ALL\n"
            f"[queue]\nsocket = {self.socket}\ndatabase = {self.dir / 'queue.sqlite'}\n"
            f"max_queued_per_user = 1000000\nstart_delay_seconds = {start_delay:g}\n"
            + bg.no_storage_caps(code)  # (10 000 jobs and the arrays: a load about speed, not disk)
        )
        self.holders = [
            subprocess.Popen(
                [sys.executable, "-c", HOLDER, str(self.dir / "dev" / f"nvidia{i}")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        for h in self.holders:
            assert h.stdout is not None and h.stdout.readline() == "open\n"
        self.daemon, self.log = bg.start_daemon(self.dir, conf, str(code))
        _wait(lambda: os.path.exists(self.socket), 60, f"{name}'s queue socket ({self.dir / 'daemon.log'})")

    def submit(self, command: List[str], **extra: object) -> float:
        # (as `gpu-mon submit` sends it: checked as the user by the client; a version that predates the
        # field ignores it)
        req = {"op": "submit", "command": command, "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, **extra}
        req["checked_as_user"] = True
        req.setdefault("output", str(self.dir / "jobs.log"))  # (not root's home: the bench leaves nothing)
        t = time.perf_counter()
        answer = ask(self.socket, req)
        took = time.perf_counter() - t
        if not answer.get("ok"):
            raise SystemExit(f"{PROG}: submit refused: {answer.get('error')}")
        return took

    def job(self, job_id: Union[int, str]) -> dict:
        (job,) = ask(self.socket, {"op": "jobs", "ids": [job_id]})["jobs"]
        return job

    def command(self, *args: str) -> float:
        """Seconds the whole `gpu-mon ARGS` took (run from the version's own code)."""
        env = dict(os.environ, PYTHONPATH=str(self.code))
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # (as installed: compiled once, then read)
        argv = [typed_gpu_mon(self.dir.parent, self.code), "--config", str(self.conf), *args]
        t = time.perf_counter()
        r = subprocess.run(
            argv, cwd=str(self.dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        took = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(f"{PROG}: gpu-mon {' '.join(args)} failed: {r.stderr[-300:]!r}")
        return took

    def start_after_free(self) -> float:
        """One trial: seconds from GPU 0's holder's close() to the job's first action."""
        fifo = self.dir / "started"
        with_fifo = not fifo.exists()
        if with_fifo:
            os.mkfifo(fifo)
        self.submit(["/bin/sh", "-c", f"echo started > {fifo}"], name="probe")
        probe = int(ask(self.socket, {"op": "jobs"})["jobs"][-1]["id"])
        _wait(lambda: "busy" in (self.job(probe)["reason"] or ""), 30, "the probe job waiting for a GPU")
        opened: Dict[str, int] = {}

        def reader() -> None:
            with open(fifo, "rb") as f:  # (returns when the job opens it to write)
                opened["t"] = time.monotonic_ns()
                f.read()

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        holder = self.holders[0]
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("close\n")
        holder.stdin.flush()
        closed = int(holder.stdout.readline())
        thread.join(self.delay + 10 * INTERVAL + 30)
        if "t" not in opened:
            raise SystemExit(f"{PROG}: the probe job did not start; see {self.dir / 'daemon.log'}")
        _wait(lambda: self.job(probe)["state"] == "done", 30, "the probe job's end")
        holder.stdin.write("open\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "open\n"
        return (opened["t"] - closed) / 1e9

    def close(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(60)
        self.log.close()
        for h in self.holders:
            h.kill()
            h.wait()


def daemon_cpu(pid: int) -> float:
    """CPU seconds (user and system, every thread) a process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_rss_mb(pid: int) -> float:
    """VmRSS of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def idle_cpu(runs: List[Run], seconds: float) -> List[float]:
    """Each daemon's CPU over the same `seconds` with nothing asked of it, in % of one core."""
    before = [daemon_cpu(run.daemon.pid) for run in runs]
    time.sleep(seconds)
    return [100 * (daemon_cpu(run.daemon.pid) - b) / seconds for run, b in zip(runs, before)]


def measure(
    runs: List[Run], jobs: int, trials: int, hostile: int, idle_seconds: float = 30.0
) -> List[Dict[str, object]]:
    """Every figure for each version, taken in turns (one submit, one command, one trial of each version
    after the other): a load that comes and goes on the machine falls on all of them alike."""
    for run in runs:
        run.submit(["true", "blocker"], hold=True)  # job 1: every other job waits --after it
    times: List[List[float]] = [[] for _ in runs]
    cpu0 = [daemon_cpu(run.daemon.pid) for run in runs]
    for i in range(jobs):
        for run, out in zip(runs, times):
            out.append(run.submit(["true", str(i)], after=[1]))
    for run in runs:
        _wait(lambda r=run: "just submitted" not in (r.job(jobs + 1)["reason"] or ""), 30, "the placement")
    cpu_submits = [daemon_cpu(run.daemon.pid) - c for run, c in zip(runs, cpu0)]
    idle = idle_cpu(runs, idle_seconds)
    for run in runs:
        run.command("jobs")  # (warm-up: compiles the version's modules)
    typed = _turns(runs, 21, lambda r: r.command("submit", "--hold", "--", "true"))
    table = _turns(runs, 5, lambda r: r.command("jobs"))
    as_json = _turns(runs, 5, lambda r: r.command("jobs", "--json"))
    starts = _turns(runs, trials, lambda r: r.start_after_free() - r.delay)
    quiet = _turns(runs, 500, lambda r: r.submit(["true", "quiet"], after=[1]))
    loud = _with_hostile(
        runs, hostile, lambda: _turns(runs, 500, lambda r: r.submit(["true", "loud"], after=[1]))
    )
    out = []
    per = zip(times, table, as_json, starts, quiet, loud, cpu_submits, idle, typed)
    for every, tab, js, st, qu, lo, cpu, idl, ty in per:
        first, last = every[: min(200, jobs)], every[-min(1000, jobs) :]
        out.append(
            {
                "typed": (statistics.median(ty), pct(ty, 99)),
                "cpu_submits": cpu,
                "idle_cpu": idl,
                "submit_0": (statistics.median(first), pct(first, 99)),
                "submit_n": (statistics.median(last), pct(last, 99)),
                "jobs_table": (statistics.median(tab), max(tab)),
                "jobs_json": (statistics.median(js), max(js)),
                "start": (statistics.median(st), max(st)),
                "hostile": (pct(qu, 99), pct(lo, 99)),
                "times": every,
            }
        )
    return out


def measure_arrays(work: Path, versions, size: int, count: int, delay: float) -> List[Dict[str, object]]:
    """The array rows, each version on a fresh daemon: `count` held `size`-element arrays submitted one
    after the other (submit -> id each), the daemon's memory before and after them, and `gpu-mon jobs`
    with them queued."""
    runs = [Run(work, f"arrays{i}", code, delay) for i, (_label, code) in enumerate(versions)]
    try:
        for run in runs:
            run.submit(["true", "blocker"], hold=True)
        rss0 = [daemon_rss_mb(run.daemon.pid) for run in runs]
        spec = f"0-{size - 1}"
        submits = _turns(runs, count, lambda r: r.submit(["true", "element"], hold=True, array=spec))
        time.sleep(2 * INTERVAL)  # (a round or two over them: each submit's answer came once it was stored)
        rss = [daemon_rss_mb(run.daemon.pid) for run in runs]
        for run in runs:
            run.command("jobs")  # (warm-up)
        listing = _turns(runs, 5, lambda r: r.command("jobs"))
    finally:
        for run in runs:
            run.close()
    return [
        {
            "submit": (statistics.median(sub), max(sub)),
            "rss": (before, after),
            "jobs_arrays": (statistics.median(lst), max(lst)),
        }
        for sub, before, after, lst in zip(submits, rss0, rss, listing)
    ]


def array_rows(
    arrays: List[Dict[str, object]], results: Dict[str, Dict[str, object]], size: int, count: int, jobs: int
) -> List[List[str]]:
    """The array rows, each version's."""
    names = list(results)
    loops = [sum(results[n]["times"]) for n in names]  # type: ignore[arg-type]
    return [
        [
            f"submit --hold --array 0-{size - 1} -> id: p50 / max of {count}",
            *(_ms(a["submit"]) for a in arrays),
        ],
        [
            f"daemon memory (VmRSS): empty -> {count} such arrays held",
            *("{:.0f} -> {:.0f} MB".format(*a["rss"]) for a in arrays),  # type: ignore[str-format]
        ],
        [
            f"gpu-mon jobs, {count} such arrays held: median / max",
            *(_ms(a["jobs_arrays"], "{:.0f} / {:.0f} ms") for a in arrays),
        ],
        [f"{jobs} single submits (a shell loop), in all", *(f"{t:.2f} s" for t in loops)],
    ]


def _turns(runs: List[Run], count: int, one) -> List[List[float]]:
    out: List[List[float]] = [[] for _ in runs]
    for _ in range(count):
        for run, values in zip(runs, out):
            values.append(one(run))
    return out


def _with_hostile(runs: List[Run], count: int, work):
    """work() while another user's hostile clients beset every daemon."""
    if count <= 0:
        return work()
    try:
        nobody = pwd.getpwnam("nobody")
        ids = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    except KeyError:
        ids = {}
    procs = []
    try:
        for run in runs:
            procs.append(
                subprocess.Popen(
                    ["/usr/bin/python3", "-I", "-c", HOSTILE, run.socket, str(count)],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd="/",
                    **ids,
                )
            )
            assert procs[-1].stdout is not None
            if procs[-1].stdout.readline() != "ready\n":
                raise SystemExit(f"{PROG}: the hostile clients did not connect")
        return work()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _ms(pair, fmt: str = "{:.1f} / {:.1f} ms") -> str:
    return fmt.format(pair[0] * 1000, pair[1] * 1000)


def rows(results: Dict[str, Dict[str, object]], jobs: int, hostile: int) -> List[List[str]]:
    names = list(results)
    out = [
        [
            "gpu-mon submit --hold -- true, the whole command: p50 / p99",
            *(_ms(results[n]["typed"]) for n in names),
        ],
        ["submit -> id p50 / p99, 0-200 queued", *(_ms(results[n]["submit_0"]) for n in names)],
        [f"submit -> id p50 / p99, {jobs} queued", *(_ms(results[n]["submit_n"]) for n in names)],
        [
            f"gpu-mon jobs (table), {jobs} queued: median / max",
            *(_ms(results[n]["jobs_table"], "{:.0f} / {:.0f} ms") for n in names),
        ],
        [
            f"gpu-mon jobs --json, {jobs} queued: median / max",
            *(_ms(results[n]["jobs_json"], "{:.0f} / {:.0f} ms") for n in names),
        ],
    ]
    start = []
    for n in names:
        med, worst = results[n]["start"]  # type: ignore[misc]
        start.append(
            f"{med * 1000:.0f} / {worst * 1000:.0f} ms ({med / INTERVAL:.2f} / {worst / INTERVAL:.2f} rounds)"
        )
    out.append(["job start after its GPU frees, less the start delay: median / max", *start])
    out.append([f"daemon CPU to take {jobs} submits", *(f"{results[n]['cpu_submits']:.1f} s" for n in names)])
    out.append(
        [f"daemon idle CPU, {jobs} queued", *(f"{results[n]['idle_cpu']:.2f} % of a core" for n in names)]
    )
    out.append(
        [
            f"submit p99 without / with {hostile} hostile connections",
            *(_ms(results[n]["hostile"]) for n in names),
        ]
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=10000, help="jobs queued (default 10000)")
    ap.add_argument(
        "--baseline", default=DEFAULT_BASELINE, help="git ref to measure side by side ('' for none)"
    )
    ap.add_argument("--trials", type=int, default=5, help="GPU-frees-to-start trials (default 5)")
    ap.add_argument("--hostile", type=int, default=1000, help="hostile connections (default 1000; 0: none)")
    ap.add_argument("--start-delay", type=float, default=1.0, help="[queue] start_delay_seconds (default 1)")
    ap.add_argument(
        "--arrays", type=int, default=10000, help="elements of the arrays measured (default 10000; 0: none)"
    )
    ap.add_argument("--array-count", type=int, default=5, help="held arrays submitted (default 5)")
    ap.add_argument("--idle-seconds", type=float, default=30, help="idle CPU window (default 30 s)")
    ap.add_argument("--json", action="store_true", help="the numbers as JSON")
    a = ap.parse_args()
    if a.jobs < 1 or a.trials < 1 or a.hostile < 0 or a.start_delay < 0:
        ap.error("--jobs and --trials must be at least 1, --hostile and --start-delay at least 0")
    problems = [] if os.geteuid() == 0 else ["needs root (the daemon runs jobs as their users: sudo)"]
    problem = _sibling("preempt").baseline_problem(a.baseline)
    if problem:
        problems.append(problem)
    if problems:
        print(f"{PROG}: cannot start: {'; '.join(problems)}", file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # (the daemons' too)
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-queue-"))
    os.chmod(work, 0o755)
    versions = [("this checkout", ROOT)]
    if a.baseline:
        old = bg.extract_ref(ROOT, a.baseline, work / "baseline-code")
        versions.append((f"baseline {a.baseline}", old))
    runs: List[Run] = []
    try:
        for i, (_label, code) in enumerate(versions):
            runs.append(Run(work, f"v{i}", code, a.start_delay))
        print(
            f"submitting {a.jobs} jobs to each of {len(runs)} daemons in turn...", file=sys.stderr, flush=True
        )
        results = dict(
            zip((label for label, _ in versions), measure(runs, a.jobs, a.trials, a.hostile, a.idle_seconds))
        )
        for run in runs:
            run.close()
        runs = []
        if a.arrays:
            print(f"arrays of {a.arrays} elements...", file=sys.stderr, flush=True)
            arrays = measure_arrays(work, versions, a.arrays, a.array_count, a.start_delay)
    finally:
        for run in runs:
            run.close()
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps({"results": results, "arrays": arrays if a.arrays else None}))
        return 0
    print(
        f"{time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPUs; kernel {os.uname().release}; "
        f"interval_seconds {INTERVAL:g}, start delay {a.start_delay:g} s; {a.trials} start trial(s)"
    )
    table = rows(results, a.jobs, a.hostile)
    if a.arrays:
        table += array_rows(arrays, results, a.arrays, a.array_count, a.jobs)
    print(bg.table(["", *results], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
