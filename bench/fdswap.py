#!/usr/bin/env python3
"""Benchmark: how long a GPU descriptor swapped in place takes to be found, with open events and polling only.

    sudo python bench/fdswap.py [--trials 5] [--interval 2] [--full-scan-seconds 10]

A real `gpu-mon run` on a simulated GPU runs a workload. A foreign process that the daemon already knows
(started before it, holding /dev/null at some fd number) then comes to hold the GPU's node in one of three
ways, and we measure the time from just after that to the workload's SIGTERM (both stamped with
CLOCK_MONOTONIC, which is system-wide):

- open + dup2: it opens the node and dup2()s it onto its /dev/null fd, then closes the new fd (its number
  of open fds is the same before and after; the open itself is an inotify event);
- received + dup2: our own workload opened the node at its start and hands the descriptor over a unix socket
  (SCM_RIGHTS); the foreign process dup2()s it onto its /dev/null fd and closes the one received (no open
  happens at all, and its fd count is unchanged);
- received: the same, keeping the descriptor at the new number it arrived at (its fd count changes).

Each in two daemons: as shipped (inotify open events, polling every --interval) and polling only
(`watch_opens = no`). --full-scan-seconds is the daemon's full_scan_seconds (60 by default in gpu-mon; less
here so that the run is short: the window scales with it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from background import median, start_daemon, table

ROOT = Path(__file__).resolve().parent.parent

# Ours: opens the GPU node, hands it to the foreign process if asked, stamps SIGTERM.
WORKLOAD = r"""
import array, json, os, signal, socket, sys, time
report, node, sock = sys.argv[1], sys.argv[2], sys.argv[3]
def say(**kw):
    with open(report, "a") as f:
        f.write(json.dumps(kw) + "\n")
def on_term(*_):
    say(event="term", pid=os.getpid(), t=time.monotonic_ns())
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
fd = os.open(node, os.O_RDONLY)
if sock != "-":
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
say(event="start", pid=os.getpid())
while True:
    time.sleep(3600)
"""

# The foreign process: known to the daemon before anything happens; told what to do on stdin.
FOREIGN = r"""
import array, os, socket, sys, time
node, path = sys.argv[1], sys.argv[2]
spare = os.open(os.devnull, os.O_RDONLY)  # the fd number a descriptor is swapped onto
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(16)
held = None
def receive():
    conn, _ = server.accept()
    fds = array.array("i")
    _msg, anc, _flags, _addr = conn.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
    conn.close()
    fds.frombytes(anc[0][2][: fds.itemsize])
    return fds[0]
print("ready", flush=True)
for line in sys.stdin:
    what = line.strip()
    if what == "open+dup2":
        new = os.open(node, os.O_RDONLY)
        os.dup2(new, spare)
        os.close(new)
        held = spare
    elif what == "received+dup2":
        new = receive()
        os.dup2(new, spare)
        os.close(new)
        held = spare
    elif what == "received":
        held = receive()
    elif what == "release":  # a change of fd count, so that the daemon sees it let go
        os.close(held)
        print("released", flush=True)
        continue
    elif what == "restore":
        if held == spare:  # (opened at the lowest free number: the one just closed, most likely)
            back = os.open(os.devnull, os.O_RDONLY)
            if back != spare:
                os.dup2(back, spare)
                os.close(back)
        print("restored", flush=True)
        continue
    print(time.monotonic_ns(), flush=True)
"""

SCENARIOS = ("open+dup2", "received+dup2", "received")


class Run:
    """One daemon, its workload and the foreign process, for one scenario and mode."""

    def __init__(self, work: Path, name: str, scenario: str, events: bool, a: argparse.Namespace):
        self.dir = work / name
        (self.dir / "dev").mkdir(parents=True)
        node = self.dir / "dev" / "nvidia0"
        node.touch()
        (self.dir / "sim.json").write_text(
            json.dumps({"gpus": [{"uuid": "GPU-bench-0", "device": "dev/nvidia0"}]})
        )
        (self.dir / "workload.py").write_text(WORKLOAD)
        self.report = self.dir / "report.jsonl"
        sock = str(self.dir / "hand.sock") if scenario.startswith("received") else "-"
        self.foreign = subprocess.Popen(
            [sys.executable, "-c", FOREIGN, str(node), str(self.dir / "hand.sock")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.foreign.stdout is not None and self.foreign.stdout.readline().strip() == "ready"
        conf = (
            f"[defaults]\ninterval_seconds = {a.interval}\nfull_scan_seconds = {a.full_scan_seconds}\n"
            f"start_delay_seconds = 0.2\nstate_file = {self.dir / 'state.json'}\n"
            f"watch_opens = {'yes' if events else 'no'}\n"
            f"[gpu-all]\ngpus = ALL\n[process-bench]\nuser = root\n"
            f"cmd = {sys.executable} {self.dir / 'workload.py'} {self.report} {node} {sock}\n"
            f"[history]\nenabled = no\n"
        )
        self.daemon, self.log = start_daemon(self.dir, conf, str(ROOT))
        self.scenario, self.full_scan = scenario, a.full_scan_seconds

    def events(self, kind: str) -> List[dict]:
        try:
            lines = self.report.read_text().splitlines()
        except OSError:
            return []
        return [e for e in (json.loads(x) for x in lines if x.strip()) if e["event"] == kind]

    def wait(self, kind: str, count: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(kind)
            if len(found) >= count:
                return found[count - 1]
            time.sleep(0.01)
        tail = (self.dir / "daemon.log").read_text(errors="replace").splitlines()[-8:]
        raise RuntimeError(
            f"no {kind} #{count} within {timeout:g} s; the daemon's last lines:\n" + "\n".join(tail)
        )

    def tell(self, what: str) -> str:
        assert self.foreign.stdin is not None and self.foreign.stdout is not None
        self.foreign.stdin.write(what + "\n")
        self.foreign.stdin.flush()
        return self.foreign.stdout.readline().strip()

    def trial(self, number: int, timeout: float) -> float:
        """Seconds from the swap to the workload's SIGTERM."""
        self.wait("start", number, 60)
        time.sleep(1.0 + random.uniform(0, self.full_scan))  # at a random point of the full-scan cycle
        swapped = int(self.tell(self.scenario))
        term = self.wait("term", number, timeout)
        assert self.tell("release") == "released"
        self.wait("start", number + 1, timeout)  # seen to let go: the GPU is free and the workload back
        assert self.tell("restore") == "restored"
        return (term["t"] - swapped) / 1e9

    def close(self) -> None:
        self.foreign.kill()
        self.foreign.wait()
        if self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(30)
        self.log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--full-scan-seconds", type=float, default=10.0)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("fdswap: run as root (the daemon's workload runs as root here)", file=sys.stderr)
        return 2
    rows = []
    results: Dict[str, List[float]] = {}
    timeout = a.full_scan_seconds + a.interval + 30
    with tempfile.TemporaryDirectory(prefix="gpu-mon-fdswap-") as tmp:
        for events in (True, False):
            for scenario in SCENARIOS:
                mode = "open events + polling" if events else "polling only"
                run = Run(Path(tmp), f"{scenario}-{int(events)}", scenario, events, a)
                try:
                    times = [run.trial(i + 1, timeout) for i in range(a.trials)]
                finally:
                    run.close()
                results[f"{scenario} / {mode}"] = times
                rows.append(
                    [scenario, mode, f"{median(times):.3f}", f"{min(times):.3f}", f"{max(times):.3f}"]
                )
    print(
        f"interval_seconds = {a.interval:g}, full_scan_seconds = {a.full_scan_seconds:g}, "
        f"{a.trials} trials each"
    )
    print(table(["how it came to hold the node", "daemon", "found after s (median)", "min", "max"], rows))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
