#!/usr/bin/env python3
"""Benchmark: the root daemon's memory under one user's hostile queue clients, beside an older version.

    sudo python bench/queue_memory.py [--jobs 300] [--stalled 16] [--churn 16] [--half 16]
                                      [--seconds 20] [--baseline 7c4bf7b] [--cap-mb 3000]

For this checkout, then for --baseline (a git ref of this checkout, extracted and run the same way; ''
for none), a real `gpu-mon run` (root) with a [queue] on two simulated GPUs. A hostile user (nobody)
submits --jobs held jobs, each with a 64 KiB argument whose every byte JSON escapes to six (\\u0001), then
for --seconds keeps open at once: --stalled clients that ask for `jobs` of those jobs (named: their
commands whole), read 16 bytes and stop reading; --churn clients that ask for the same, read 16 bytes and
close (again and again); --half clients that send a 1 MiB frame but its last byte. Each is reopened when
the daemon closes it. Meanwhile another user (root) submits a held job every 0.1 s; each submit's time to
its answer is measured (60 s at most). Afterwards, with the load gone, `gpu-mon jobs --json` lists every
job (this version's own command).

The daemon's memory is read from /proc/PID/status: VmRSS before the load, VmHWM (peak) at the end. A
daemon whose VmRSS passes --cap-mb is stopped there (the machine's memory is shared): its peak reads
">CAP". The versions run one after the other, never at once.

Prints a table (the machine and date above it).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import extract_ref, no_storage_caps, queue_request, sim_gpus, start_daemon, table  # noqa: E402

PROG = "bench/queue_memory.py"
DEFAULT_BASELINE = "7c4bf7b"  # before answers in pages and the limits on what one user's clients hold
ARG_BYTES = 65000  # of "\x01": 6 bytes each in JSON (the command's limit is 64 KiB)

# The hostile user's clients: `submit N` submits N held jobs; `load STALLED CHURN HALF N` runs the load
# (its `jobs` asks name the N jobs: ids 1..N in a fresh database) until SIGTERM, then prints what it saw as
# JSON.
HOSTILE = r"""
import json, os, select, signal, socket, struct, sys, time
path, mode = sys.argv[1], sys.argv[2]
def frame(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body
if mode == "submit":
    for i in range(int(sys.argv[3])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(frame({"op": "submit", "command": ["true", "\x01" * int(sys.argv[4])], "cwd": "/",
                         "env": {"PATH": "/bin"}, "hold": True, "output": "/tmp/gpu-mon-bench-%j.log"}))
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            chunk = s.recv(65536)
            if not chunk:
                sys.exit("closed without an answer")
            data += chunk
        answer = json.loads(data[4:])
        if not answer.get("ok"):
            sys.exit("submit refused: " + str(answer.get("error")))
        s.close()
    sys.exit(0)
stalled, churn, half, jobs = (int(v) for v in sys.argv[3:7])
# (named: a listing that names its jobs gives their commands whole; since 2026-11-28 others cut them)
ASK = frame({"op": "jobs", "all": True, "ids": list(range(1, jobs + 1))})
BIG = 1 << 20
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
poller = select.poll()
conns = {}  # fd -> [socket, kind, phase, bytes so far]
seen = {"answers": 0, "refusals": 0, "reconnects": 0, "connect_errors": 0}
def add(kind):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        if kind != "half":
            s.sendall(ASK)
        else:
            s.sendall(struct.pack(">I", BIG))
    except OSError:
        s.close()
        seen["connect_errors"] += 1
        want.append(kind)
        return
    s.setblocking(False)
    conns[s.fileno()] = [s, kind, "read" if kind != "half" else "send", 0]
    poller.register(s, select.POLLIN if kind != "half" else select.POLLOUT)
def drop(fd):
    s, kind = conns.pop(fd)[:2]
    poller.unregister(fd)
    s.close()
    seen["reconnects"] += 1
    want.append(kind)
def event(fd, ev):
    c = conns[fd]
    s, kind, phase = c[0], c[1], c[2]
    if phase == "send":
        try:
            c[3] += s.send(b"x" * min(65536, BIG - 1 - c[3]))
        except BlockingIOError:
            return
        except OSError:
            return drop(fd)
        if c[3] >= BIG - 1:
            c[2] = "hold"
            poller.modify(fd, select.POLLIN)
        return
    if phase == "read":
        try:
            data = s.recv(16 - c[3])
        except BlockingIOError:
            return
        except OSError:
            return drop(fd)
        if data and c[3] == 0:
            seen["refusals" if b'"ok":false' in data or b'"ok": false' in data else "answers"] += 1
        c[3] += len(data)
        if not data or c[3] >= 16 and kind == "churn":
            return drop(fd)
        if c[3] >= 16:
            c[2] = "hold"
            poller.modify(fd, 0x2000)  # POLLRDHUP: told when the daemon closes it, read nothing more
        return
    if ev & (select.POLLHUP | select.POLLERR | 0x2000):
        return drop(fd)
    try:  # (a half-sender: the daemon's one-line error, then its close)
        if not s.recv(65536):
            drop(fd)
    except BlockingIOError:
        pass
    except OSError:
        drop(fd)
want = ["stalled"] * stalled + ["churn"] * churn + ["half"] * half
print("ready", flush=True)
while not stop:
    todo, want[:] = list(want), []
    for kind in todo:
        add(kind)
    if want:  # (connects that failed: again after a moment)
        time.sleep(0.01)
    for fd, ev in poller.poll(20):
        if fd in conns:
            event(fd, ev)
print(json.dumps(seen), flush=True)
"""


def status_kb(pid: int, key: str) -> Optional[int]:
    """A field of /proc/PID/status in kB (VmRSS, VmHWM); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Run:
    """One daemon under test (this checkout or the baseline)."""

    def __init__(self, work: Path, name: str, code: Path):
        self.dir, self.code = work / name, code
        self.dir.mkdir()
        os.chmod(self.dir, 0o755)
        sim_gpus(self.dir)
        self.socket = str(self.dir / "run" / "queue.sock")
        self.conf = (
            f"[defaults]\nstate_file = {self.dir / 'state.json'}\ninterval_seconds = 2\n"
            f"[history]\nenabled = no\n[gpu-all]\ngpus = ALL\n"
            f"[queue]\nsocket = {self.socket}\ndatabase = {self.dir / 'queue.sqlite'}\n"
            f"max_queued_per_user = 100000\n{no_storage_caps(code)}"
        )
        self.daemon, self.log = start_daemon(self.dir, self.conf, str(code))
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise SystemExit(f"{PROG}: no queue socket; see {self.dir / 'daemon.log'}")
            time.sleep(0.05)

    def rss_mb(self, key: str = "VmRSS") -> float:
        return (status_kb(self.daemon.pid, key) or 0) / 1024

    def jobs_json(self) -> str:
        """`gpu-mon jobs --json` of this version, as root: `N jobs in S s`, or why it failed."""
        env = dict(os.environ, PYTHONPATH=str(self.code))
        argv = [sys.executable, "-m", "gpu_mon", "--config", str(self.dir / "gpu_mon.conf"), "jobs", "--json"]
        out = self.dir / "jobs.json"
        t = time.perf_counter()
        with open(out, "wb") as f:
            r = subprocess.run(argv, cwd=str(self.dir), stdout=f, stderr=subprocess.PIPE, env=env)
        took = time.perf_counter() - t
        if r.returncode != 0:
            return "failed: " + r.stderr.decode(errors="replace").strip().splitlines()[-1][:60]
        with open(out) as f:
            count = len(json.load(f)["jobs"])
        out.unlink()
        return f"{count} jobs in {took:.1f} s"

    def close(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.log.close()


class Watch:
    """Reads the daemon's VmRSS every 20 ms; past the cap, kills it (SIGKILL: its memory is given back at
    once) and says so."""

    def __init__(self, run: Run, cap_mb: float):
        self.run, self.cap = run, cap_mb
        self.capped, self.peak = False, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.run.rss_mb())
            if self.peak > self.cap:
                self.capped = True
                self.run.daemon.kill()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def hostile(run: Run, *args: str) -> subprocess.Popen:
    nobody = pwd.getpwnam("nobody")
    return subprocess.Popen(
        ["/usr/bin/python3", "-I", "-c", HOSTILE, run.socket, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        user=nobody.pw_uid,
        group=nobody.pw_gid,
        extra_groups=[],
    )


def measure(run: Run, a: argparse.Namespace) -> Dict[str, object]:
    """Submit the big jobs, then the hostile load for a.seconds with another user's submits."""
    sub = hostile(run, "submit", str(a.jobs), str(ARG_BYTES))
    if sub.wait() != 0:
        raise SystemExit(f"{PROG}: the hostile user's submits failed")
    before = run.rss_mb()
    load = hostile(run, "load", str(a.stalled), str(a.churn), str(a.half), str(a.jobs))
    assert load.stdout is not None
    if load.stdout.readline() != "ready\n":
        raise SystemExit(f"{PROG}: the hostile clients did not start")
    times: List[float] = []
    failed = 0
    watch = Watch(run, a.cap_mb)
    end = time.monotonic() + a.seconds
    try:
        while time.monotonic() < end and not watch.capped:
            t = time.perf_counter()
            try:
                answer = queue_request(run.socket, _probe(), timeout=60)
                (times if answer.get("ok") else []).append(time.perf_counter() - t)
                failed += 0 if answer.get("ok") else 1
            except OSError:
                failed += 0 if watch.capped else 1
            time.sleep(0.1)
    finally:
        watch.stop()
        load.send_signal(signal.SIGTERM)
        seen = json.loads(load.communicate(timeout=60)[0].splitlines()[-1] or "{}")
    capped = watch.capped
    hwm = watch.peak if capped else run.rss_mb("VmHWM")
    return {
        "before": before,
        "peak": hwm,
        "capped": capped,
        "submits": times,
        "failed": failed,
        "seen": seen,
        "jobs_json": "- (stopped at the cap)" if capped else run.jobs_json(),
    }


def _probe() -> dict:
    return {"op": "submit", "command": ["true", "probe"], "cwd": "/", "env": {"PATH": "/bin"}, "hold": True}


def rows(results: Dict[str, Dict[str, object]], a: argparse.Namespace) -> List[List[str]]:
    names = list(results)

    def each(fn) -> List[str]:
        return [fn(results[n]) for n in names]

    def peak(r) -> str:
        return f">{a.cap_mb:.0f} MB (stopped)" if r["capped"] else f"{r['peak']:.0f} MB"

    def submits(r) -> str:
        t = r["submits"]
        if not t:
            return f"none answered ({r['failed']} failed)"
        fails = f", {r['failed']} failed" if r["failed"] else ""
        return f"{statistics.median(t) * 1000:.0f} / {max(t) * 1000:.0f} ms ({len(t)}{fails})"

    def seen(r) -> str:
        s = r["seen"]
        return f"{s.get('answers', 0)} / {s.get('refusals', 0)}"

    load = f"{a.stalled} stalled + {a.churn} churning + {a.half} half-sending clients"
    return [
        [f"daemon RSS, {a.jobs} big jobs queued, before the load", *each(lambda r: f"{r['before']:.0f} MB")],
        [f"daemon peak RSS (VmHWM) under {load}, {a.seconds:g} s", *each(peak)],
        ["another user's submit under the load: p50 / max (answered)", *each(submits)],
        ["hostile `jobs` asks answered / refused in one line", *each(seen)],
        [f"gpu-mon jobs --json ({a.jobs} big jobs and the probes), after", *each(lambda r: r["jobs_json"])],
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=300, help="the hostile user's big held jobs (default 300)")
    ap.add_argument("--stalled", type=int, default=16, help="clients that stop reading (default 16)")
    ap.add_argument("--churn", type=int, default=16, help="clients that read 16 bytes and close (default 16)")
    ap.add_argument("--half", type=int, default=16, help="clients that half-send 1 MiB frames (default 16)")
    ap.add_argument("--seconds", type=float, default=20, help="the load's length (default 20)")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="git ref to measure too ('' for none)")
    ap.add_argument("--cap-mb", type=float, default=3000, help="stop a daemon past this RSS (default 3000)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print(f"{PROG}: cannot start: needs root (the daemon runs as root; the hostile user is nobody)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-qmem-"))
    os.chmod(work, 0o755)
    versions = [("this checkout", ROOT)]
    if a.baseline:
        versions.append((f"baseline {a.baseline}", extract_ref(ROOT, a.baseline, work / "baseline-code")))
    results: Dict[str, Dict[str, object]] = {}
    try:
        for i, (label, code) in enumerate(versions):
            print(f"{label}: {a.jobs} big jobs, then the load...", file=sys.stderr, flush=True)
            run = Run(work, f"v{i}", code)
            try:
                results[label] = measure(run, a)
            finally:
                run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPUs; kernel {os.uname().release}")
    print(table(["", *results], rows(results, a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
