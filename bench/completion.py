#!/usr/bin/env python3
"""Benchmark: a TAB after `gpu-mon cancel ` with 10 000 of the user's jobs queued.

    sudo python bench/completion.py [--jobs 10000] [--trials 50]

A real `gpu-mon run` (root) with a [queue] on two simulated GPUs; --jobs jobs submitted held through the
socket (as `gpu-mon submit --hold` does), all root's, so that `cancel` completes to every one of them.
Timed, each --trials times, p50 and p99:

- `gpu-mon _job-ids cancel` as the .deb installs gpu-mon (/usr/bin/python3 running a console script
  that imports gpu_mon.jobids), with the socket at its default place (the fast path: no config read);
- the whole TAB: bash sourcing docs/completion/bash/gpu-mon and running its completion function;
- the same with the venv's interpreter (`python -m gpu_mon`, as a pip install runs it);
- with the config named (--config on the line): the config is read for [queue] socket (the slow path).

The default socket /run/gpu_mon/queue.sock is used for the fast path: the benchmark refuses to run when
something is there already, and removes /run/gpu_mon again if it made it. Prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROG = "bench/completion.py"
DEFAULT_SOCKET = Path("/run/gpu_mon/queue.sock")
BASH = ROOT / "docs" / "completion" / "bash" / "gpu-mon"


sys.path.insert(0, str(BENCH))
import background as bg  # noqa: E402


def _time(argv: List[str], trials: int, expect: int, env: Dict[str, str]) -> List[float]:
    """Wall time of each run (ms); every run must print `expect` ids."""
    took = []
    for _ in range(trials):
        t = time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", check=True).stdout
        took.append((time.perf_counter() - t) * 1000)
        if len(out.split()) != expect:
            raise SystemExit(f"{PROG}: {' '.join(argv)} printed {len(out.split())} ids, not {expect}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--trials", type=int, default=50)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit(f"{PROG}: run as root (the daemon's queue)")
    if os.path.lexists(DEFAULT_SOCKET):
        raise SystemExit(f"{PROG}: {DEFAULT_SOCKET} exists (a daemon runs here?): not touching it")
    made_run_dir = not DEFAULT_SOCKET.parent.exists()
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-bench-completion-"))
    daemon = log = None
    try:
        bg.sim_gpus(work)
        conf = (
            f"[defaults]\nstate_file = {work / 'state.json'}\n[history]\nenabled = no\n"
            "[gpu-all]\ngpus = ALL\n"
            f"[queue]\ndatabase = {work / 'queue.sqlite'}\nmax_queued_per_user = 1000000\n"
        )
        daemon, log = bg.start_daemon(work, conf, str(ROOT))
        bg.wait_until(DEFAULT_SOCKET.exists, 60, f"the queue's socket ({work / 'daemon.log'})", PROG)
        t = time.monotonic()
        for _ in range(args.jobs):
            req = {"op": "submit", "command": ["true"], "cwd": "/", "env": {}, "hold": True}
            if not bg.queue_request(str(DEFAULT_SOCKET), req).get("ok"):
                raise SystemExit(f"{PROG}: a submit was refused")
        submitted = time.monotonic() - t
        # A console script as the .deb's /usr/bin/gpu-mon is, on this checkout.
        script = work / "gpu-mon"
        script.write_text(
            f"#!/usr/bin/python3\nimport sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            "from gpu_mon.entry import console_main\nconsole_main()\n"
        )
        os.chmod(script, 0o755)
        venv = work / "venv-bin"
        venv.mkdir()
        (venv / "gpu-mon").write_text(f'#!/bin/sh\nexec {sys.executable} -m gpu_mon "$@"\n')
        os.chmod(venv / "gpu-mon", 0o755)
        env = {"PATH": f"{work}:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}
        venv_env = dict(env, PATH=f"{venv}:/usr/bin:/bin")
        tab = (
            f"source {BASH}; COMP_WORDS=(gpu-mon CONFIG cancel ''); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1));"
            '_gpu_mon; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        named = f"--config {work / 'gpu_mon.conf'}"
        n, k = args.jobs, args.trials
        rows = [
            (
                "gpu-mon _job-ids cancel (system python3, default socket)",
                _time([str(script), "_job-ids", "cancel"], k, n, env),
            ),
            (
                "TAB in bash: gpu-mon cancel <TAB> (system python3)",
                _time(["bash", "-c", tab.replace("CONFIG", "")], k, n, env),
            ),
            (
                "gpu-mon _job-ids cancel (venv python -m gpu_mon)",
                _time([str(venv / "gpu-mon"), "_job-ids", "cancel"], k, n, venv_env),
            ),
            (
                "TAB in bash, --config named (the config is read)",
                _time(["bash", "-c", tab.replace("CONFIG", named)], k, n, env),
            ),
            (
                "python3 -c pass (the interpreter's start alone)",
                _time(["/usr/bin/python3", "-c", "pass"], k, 0, env),
            ),
        ]
        print(
            f"{time.strftime('%Y-%m-%d %H:%M')}  {os.uname().nodename}  {os.cpu_count()} CPUs  "
            f"load {os.getloadavg()[0]:.2f}; {n} of the user's jobs queued (submitted in {submitted:.1f} s)"
        )
        print(
            bg.table(
                ["", "p50 ms", "p99 ms"],
                [(name, f"{bg.percentile(v, 50):.1f}", f"{bg.percentile(v, 99):.1f}") for name, v in rows],
            )
        )
        return 0
    finally:
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if log is not None:
            log.close()
        shutil.rmtree(work, ignore_errors=True)
        if made_run_dir:
            shutil.rmtree(DEFAULT_SOCKET.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
