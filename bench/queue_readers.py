#!/usr/bin/env python3
"""Benchmark: one user's arrays and looping readers against everyone's `jobs` (issue 46, item 4).

    sudo python bench/queue_readers.py [--arrays 5] [--elements 1000] [--arg-bytes 60000]
                                       [--readers 3] [--seconds 20] [--trials 3] [--baseline 71478dc]

For this checkout, then for --baseline (a git ref of this checkout, extracted with `git archive` and run
the same way; '' for none), a real `gpu-mon run` (root) with a [queue] on two simulated GPUs, at its
default limits. A plain user (nobody) submits --arrays held arrays of --elements elements with one
--arg-bytes argument (`x`), and cancels them (the issue's case: within the caps). Then another plain user
(daemon) runs its version's `gpu-mon jobs --all --json` --trials times: the size of what it prints and
how long it takes. Then nobody starts --readers looping readers (raw clients that ask for `jobs --all`
and read the whole answer, again and again) for --seconds; after 2 s the daemon's CPU (the whole process)
is measured, and meanwhile the other user runs `jobs --all --json` and `submit --hold` in turns, each
timed. The versions run one after the other, never at once.

Checks first what it needs (root, the users nobody and daemon, git and the ref) and says all of it in one
line, exit 2. Prints a table (the machine and date above it).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import extract_ref, median, queue_request, sim_gpus, start_daemon, table  # noqa: E402
from preempt import baseline_problem, cpu_ticks  # noqa: E402

PROG = "bench/queue_readers.py"
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # (the users run it)
HOSTILE, OTHER = "nobody", "daemon"

# As nobody: `submit ARRAYS ELEMENTS BYTES` submits and cancels the arrays; `read SECONDS READERS` runs the
# looping readers (forked), then prints {answers, slowed, refused} in all.
CLIENT = r"""
import json, os, socket, struct, sys, time
path, mode = sys.argv[1], sys.argv[2]
def ask(obj, keep=True):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(120)
    s.connect(path)
    body = json.dumps(obj).encode()
    s.sendall(struct.pack(">I", len(body)) + body)
    buf, first, slowed = b"", None, False
    while True:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack(">I", buf[:4])[0]:
            chunk = s.recv(1 << 20)
            if not chunk:
                s.close()
                return first, slowed, "closed"
            buf += chunk
        size = 4 + struct.unpack(">I", buf[:4])[0]
        page, buf = buf[4:size], buf[size:]
        tail = page[-400:]
        slowed = slowed or b'"slowed":' in tail
        if first is None:
            first = json.loads(page) if keep else page[:200]
        if b'"ok":false' in page[:40] or b'"continued":true' not in tail:
            s.close()
            return first, slowed, "refused" if b'"ok":false' in page[:40] else "answered"
if mode == "submit":
    arrays, elements, size = (int(v) for v in sys.argv[3:6])
    for _ in range(arrays):
        req = {"op": "submit", "command": ["true", "x" * size], "cwd": "/", "env": {"PATH": "/bin"},
               "hold": True, "array": "0-%d" % (elements - 1), "checked_as_user": True,
               "output": "/tmp/gpu-mon-bench-readers-%A_%a.log"}
        answer = ask(req)[0]
        if not answer.get("ok"):
            sys.exit("submit refused: " + str(answer.get("error")))
        answer = ask({"op": "cancel", "ids": [answer["id"]]})[0]
        if not answer.get("ok"):
            sys.exit("cancel refused: " + str(answer.get("error")))
    sys.exit(0)
seconds, readers = float(sys.argv[3]), int(sys.argv[4])
def loop(fd):
    seen = {"answers": 0, "slowed": 0, "refused": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            _, slowed, how = ask({"op": "jobs", "all": True}, keep=False)
        except OSError:
            continue
        seen["answers"] += how == "answered"
        seen["refused"] += how == "refused"
        seen["slowed"] += slowed
    os.write(fd, (json.dumps(seen) + "\n").encode())
r, w = os.pipe()
for _ in range(readers):
    if os.fork() == 0:
        loop(w)
        os._exit(0)
os.close(w)
total = {}
with os.fdopen(r) as f:
    for line in f:
        for k, v in json.loads(line).items():
            total[k] = total.get(k, 0) + v
print(json.dumps(total), flush=True)
"""


def missing_prerequisites(a: argparse.Namespace) -> List[str]:
    """Everything the run needs and lacks, checked before anything starts."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (the daemon runs as root, the users as nobody and daemon: sudo)")
    for name in (HOSTILE, OTHER):
        try:
            pwd.getpwnam(name)
        except KeyError:
            out.append(f"needs the user {name}")
    problem = baseline_problem(a.baseline)
    if problem:
        out.append(problem)
    return out


class Run:
    """One daemon under test (this checkout or the baseline), its queue on two simulated GPUs."""

    def __init__(self, work: Path, code: Path):
        self.dir, self.code = work, code
        work.mkdir()
        os.chmod(work, 0o755)
        sim_gpus(work)
        self.socket = str(work / "run" / "queue.sock")
        conf = (
            f"[defaults]\nstate_file = {work / 'state.json'}\n[history]\nenabled = no\n"
            "[gpu-all]\ngpus = ALL\n"
            f"[queue]\nsocket = {self.socket}\ndatabase = {work / 'queue.sqlite'}\nlauncher = direct\n"
        )
        self.client_conf = work / "client.conf"
        self.client_conf.write_text(f"[queue]\nsocket = {self.socket}\n")
        os.chmod(self.client_conf, 0o644)
        self.daemon, self.log = start_daemon(work, conf, str(code))
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if time.monotonic() > deadline or self.daemon.poll() is not None:
                raise RuntimeError(f"no queue socket; see {work / 'daemon.log'}")
            time.sleep(0.05)
        queue_request(self.socket, {"op": "jobs"})  # (answering)

    def as_user(self, name: str, argv: List[str], **kw) -> subprocess.Popen:
        u = pwd.getpwnam(name)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(self.code), "LANG": "C.UTF-8", "HOME": "/"}
        return subprocess.Popen(
            argv, user=u.pw_uid, group=u.pw_gid, extra_groups=[], cwd="/", env=env, text=True, **kw
        )

    def client(self, *args: str, **kw) -> subprocess.Popen:
        """CLIENT as nobody."""
        return self.as_user(HOSTILE, [PY, "-I", "-c", CLIENT, self.socket, *args], **kw)

    def gpu_mon(self, *args: str) -> Tuple[float, int, str]:
        """This version's `gpu-mon ARGS` as the other user: (seconds, bytes printed, stderr)."""
        out = self.dir / "out"
        with open(out, "wb") as f:
            t = time.perf_counter()
            p = self.as_user(
                OTHER,
                [PY, "-m", "gpu_mon", "--config", str(self.client_conf), *args],
                stdout=f,
                stderr=subprocess.PIPE,
            )
            _, err = p.communicate(timeout=600)
            took = time.perf_counter() - t
        size = out.stat().st_size
        out.unlink()
        if p.returncode != 0:
            raise RuntimeError(f"gpu-mon {' '.join(args)}: {err.strip()[-200:]}")
        return took, size, err

    def close(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.log.close()


def measure(run: Run, a: argparse.Namespace) -> Dict[str, object]:
    """The arrays, the quiet listings, then the readers with the other user's commands and the CPU."""
    sub = run.client("submit", str(a.arrays), str(a.elements), str(a.arg_bytes), stderr=subprocess.PIPE)
    _, err = sub.communicate(timeout=600)
    if sub.returncode != 0:
        raise RuntimeError(f"the arrays: {err.strip()[-200:]}")
    quiet = [run.gpu_mon("jobs", "--all", "--json") for _ in range(a.trials)]
    readers = run.client("read", str(a.seconds), str(a.readers), stdout=subprocess.PIPE)
    time.sleep(2.0)
    pid, tick = run.daemon.pid, os.sysconf("SC_CLK_TCK")
    ticks0, t0 = cpu_ticks(pid), time.monotonic()
    listed: List[float] = []
    submits: List[float] = []
    slowed = 0
    while time.monotonic() - t0 < a.seconds - 3:
        took, _size, err = run.gpu_mon("jobs", "--all", "--json")
        listed.append(took)
        slowed += "late" in err
        took, _size, _err = run.gpu_mon(
            "submit", "--hold", "--output", "/tmp/gpu-mon-bench-%j.log", "--", "true"
        )
        submits.append(took)
    cpu = 100.0 * (cpu_ticks(pid) - ticks0) / tick / (time.monotonic() - t0)
    out, _ = readers.communicate(timeout=600)
    return {"quiet": quiet, "cpu": cpu, "listed": listed, "submits": submits, "seen": json.loads(out)}


def rows(results: Dict[str, Dict[str, object]], a: argparse.Namespace) -> List[List[str]]:
    names = list(results)

    def each(fn) -> List[str]:
        return [fn(results[n]) for n in names]

    def ms(values: List[float]) -> str:
        return f"{median(values) * 1000:.0f} / {max(values) * 1000:.0f} ms ({len(values)})" if values else "-"

    case = f"{a.arrays} cancelled arrays of {a.elements} with a {a.arg_bytes // 1000} KB argument"
    loop = f"{a.readers} looping readers of nobody's"
    return [
        [f"`jobs --all --json` size, {case}", *each(lambda r: f"{r['quiet'][0][1] / 1e6:.1f} MB")],
        [f"`jobs --all --json` p50 / max, {a.trials} alone", *each(lambda r: ms([q[0] for q in r["quiet"]]))],
        [f"daemon CPU under {loop}, {a.seconds - 3:g} s", *each(lambda r: f"{r['cpu']:.0f} % of a core")],
        ["their answers / told slowed / refused", *each(_seen)],
        ["another user's `jobs --all --json` meanwhile, p50 / max", *each(lambda r: ms(r["listed"]))],
        ["another user's `submit --hold` meanwhile, p50 / max", *each(lambda r: ms(r["submits"]))],
    ]


def _seen(r: Dict[str, object]) -> str:
    s = r["seen"]
    assert isinstance(s, dict)
    return f"{s.get('answers', 0)} / {s.get('slowed', 0)} / {s.get('refused', 0)}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--arrays", type=int, default=5, help="nobody's cancelled arrays (default 5)")
    ap.add_argument("--elements", type=int, default=1000, help="elements each (default 1000)")
    ap.add_argument("--arg-bytes", type=int, default=60000, help="their argument's bytes (default 60000)")
    ap.add_argument("--readers", type=int, default=3, help="nobody's looping readers (default 3)")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long they loop (default 20)")
    ap.add_argument("--trials", type=int, default=3, help="listings alone, before the readers (default 3)")
    ap.add_argument("--baseline", default="71478dc", help="git ref to measure too ('' for none)")
    a = ap.parse_args(argv)
    if min(a.arrays, a.elements, a.arg_bytes, a.readers, a.trials) < 1 or a.seconds < 5:
        ap.error("--arrays, --elements, --arg-bytes, --readers and --trials must be at least 1, --seconds 5")
    missing = missing_prerequisites(a)
    if missing:
        print(f"{PROG}: cannot start: {'; '.join(missing)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-readers-"))
    os.chmod(work, 0o755)
    versions = [("this checkout", ROOT)]
    if a.baseline:
        versions.append((f"baseline {a.baseline}", extract_ref(ROOT, a.baseline, work / "baseline-code")))
    results: Dict[str, Dict[str, object]] = {}
    try:
        for i, (label, code) in enumerate(versions):
            print(f"{label}: the arrays, {a.trials} listings, then {a.readers} readers...", file=sys.stderr)
            run = Run(work / f"v{i}", code)
            try:
                results[label] = measure(run, a)
            finally:
                run.close()
    except RuntimeError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPUs; kernel {os.uname().release}")
    print(table(["", *results], rows(results, a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
