#!/usr/bin/env python3
"""A four-minute day in the life of a shared GPU server, recorded by a real daemon, then reported.

    sudo python examples/history_demo.py [--plot docs/history-demo.png]

Runs `gpu-mon run` on two simulated GPUs (a copy of examples/sim-host.json in a temporary directory, with
[history] recording there) and plays a script against it: workloads harvest both GPUs; a user's program
opens GPU 0 (a preemption); another user's process sits on 6 GB of GPU 1 at 0% (foreign use, then an idle
holder); someone types at a terminal (everything pauses); GPU 1 becomes unreadable for a while (unknown);
a short job takes GPU 1. Then it prints `gpu-mon report` for those minutes and draws the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN = "import sys, time; f = open(sys.argv[1]); time.sleep(float(sys.argv[2]))"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default=None, help="also write the plot here (.png or .svg)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-demo-"))
    (work / "dev").mkdir()
    (work / "pts").mkdir()
    host = json.loads((ROOT / "examples" / "sim-host.json").read_text())
    gpu = host["gpus"]

    def sim(**changes: object) -> None:
        for i, fields in changes.items():
            gpu[int(i[1:])].update(fields)  # type: ignore[arg-type]
        tmp = work / "host.json.tmp"
        tmp.write_text(json.dumps(host))
        os.replace(tmp, work / "host.json")

    sim()
    terminal = work / "pts" / "7"
    terminal.touch()
    os.utime(terminal, (time.time() - 3600, time.time() - 3600))
    conf = work / "demo.conf"
    conf.write_text(
        f"[defaults]\ninterval_seconds = 0.5\nstart_delay_seconds = 5\nstate_file = {work / 'state.json'}\n"
        "[gpu-all]\ngpus = ALL\nidle_holder_seconds = 20\n"
        "[process-miner]\ncmd = sleep 100000\nper_gpu = yes\nuser = root\n"
        f"[tty]\nenabled = yes\ndevices = {work / 'pts' / '*'}\nidle_seconds = 10\n"
        f"[history]\npath = {work / 'history.sqlite'}\nsample_seconds = 5\n"
    )
    os.chmod(conf, 0o600)
    gpu_mon = [sys.executable, "-m", "gpu_mon", "--config", str(conf)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it until the end
    daemon = subprocess.Popen(
        [*gpu_mon, "--sim", str(work / "host.json"), "run"], stdout=log, stderr=log, env=env
    )
    t0 = time.time()

    def at(second: float, what: str) -> None:
        time.sleep(max(0.0, t0 + second - time.time()))
        print(f"{second:5.0f} s  {what}", flush=True)

    def user_program(device: int, seconds: float) -> None:
        subprocess.Popen([sys.executable, "-c", OPEN, str(work / "dev" / f"nvidia{device}"), str(seconds)])

    try:
        at(0, "the daemon starts; both GPUs free: workloads start after 5 s")
        at(30, "a user's program opens GPU 0 for 40 s")
        user_program(0, 40)
        sleeper = subprocess.Popen(["sleep", "100000"])
        at(80, "another user's process holds 6 GB of GPU 1 at 0% for 60 s")
        sim(
            g1={
                "memory_used_mib": 6000,
                "processes": [{"pid": sleeper.pid, "used_memory_mib": 6000, "utilization_pct": 0}],
            }
        )
        at(140, "it lets go of GPU 1")
        sim(g1={"memory_used_mib": 0, "processes": []})
        sleeper.kill()
        at(150, "someone types at a terminal for 20 s")
        for _ in range(5):
            os.utime(terminal)
            time.sleep(4)
        at(190, "GPU 1 cannot be read for 15 s")
        sim(g1={"error": "GPU is lost"})
        at(205, "GPU 1 is back")
        gpu[1].pop("error", None)
        sim()
        at(215, "a short job opens GPU 1 for 10 s")
        user_program(1, 10)
        at(245, "the end")
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0 - 5))
    subprocess.run([*gpu_mon, "report", "--since", since], env=env, check=True)
    if a.plot:
        subprocess.run(
            [*gpu_mon, "report", "--since", since, "--plot", a.plot],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        print(f"plot: {a.plot}")
    print(f"(files in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
