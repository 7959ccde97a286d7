"""What one restart of gpu-mon costs a running queue job, under a real systemd.

    sudo python bench/restart.py [--baseline REF] [--trials 3] [--ran 5]

For this checkout and for --baseline (a git ref of this checkout, extracted; '' for none), a container boots
a systemd (tests/nspawn.py, as the tests do) with that version's shipped gpu-mon.service, a drop-in that only
says where its code is, simulated GPUs and a [queue]; a plain user of the container submits a job that
writes a tick (its pid and the time) every 50 ms. When it has run --ran seconds, `systemctl restart gpu-mon`;
then, once a tick comes from a job that runs again, the figures of that trial:

- survived: the same process ticks on (the run was not stopped);
- run time lost: what the stopped run had done (its time from its first tick to the restart; 0 if it
  survived);
- gap: the longest time without a tick around the restart (the job's downtime);
- restarts: its restart count after.

Needs root and systemd-nspawn (Debian's systemd-container), as tests/test_under_systemd.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import background as bg  # noqa: E402
from conftest import SimHost, wait_for  # noqa: E402
from nspawn import Container, python_binds  # noqa: E402
from test_under_systemd import _site_dirs  # noqa: E402

DEFAULT_BASELINE = "71478dc"
SRV = "/srv/gpu-mon-bench"
CODE = "/srv/gpu-mon-code"
USER = "gmbench"
UNIT = "gpu-mon.service"
TICKER = """\
import os, sys, time
path = os.path.join(os.environ["HOME"], "ticks")
while True:
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {time.time():.3f}\\n")
    time.sleep(0.05)
"""
CONFIG = """\
[defaults]
start_delay_seconds = 0
interval_seconds = 2

[gpu-all]
gpus = ALL

[queue]
grace_seconds = 3
"""


def _drop_in() -> str:
    path = ":".join([CODE] + [f"{CODE}-site{i}" for i in range(len(_site_dirs()))])
    python = os.path.realpath(sys.executable)
    return (
        f"[Service]\nEnvironment=GPU_MON_SIM={SRV}/sim.json PYTHONPATH={path}\n"
        f"ExecStart=\nExecStart={python} -m gpu_mon run\n"
    )


@contextlib.contextmanager
def booted(code: Path, work: Path) -> Iterator[Container]:
    """A container whose gpu-mon.service is `code`'s, with the user and the ticker."""
    srv = work / "srv"
    srv.mkdir()
    os.chmod(srv, 0o755)
    SimHost(srv, 1)
    (srv / "ticker.py").write_text(TICKER)
    binds = [f"{code}:{CODE}"] + [f"{d}:{CODE}-site{i}" for i, d in enumerate(_site_dirs())]
    binds += [p for p in python_binds() if not p.startswith(str(code))]
    box = Container(work, binds_ro=binds, binds_rw={str(srv): SRV})
    try:
        box.boot()
        box.write(f"/etc/systemd/system/{UNIT}", (code / "systemd" / UNIT).read_text())
        box.write(f"/etc/systemd/system/{UNIT}.d/bench.conf", _drop_in())
        box.write("/etc/gpu_mon.conf", CONFIG, 0o600)
        box.write("/etc/gpu-mon-client.conf", "[queue]\n")
        box.run(["systemctl", "daemon-reload"])
        box.run(["useradd", "-m", "-s", "/bin/sh", USER])
        box.run(["systemctl", "start", UNIT])
        yield box
    finally:
        left = box.stop()
        if left:
            print(f"warning: the container left {left}", file=sys.stderr)


def _client(box: Container, *args: str) -> str:
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"HOME=/home/{USER}", f"USER={USER}", f"PYTHONPATH={CODE}"]
    python = "/usr/bin/python3"  # (as a user would: the system's, this checkout's package on its path)
    uid = box.run(["id", "-u", USER]).stdout.strip()
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--init-groups", *env, "sh", "-c"]
    argv += ['cd "$HOME" && exec "$@"', "sh", python, "-m", "gpu_mon", "--config", "/etc/gpu-mon-client.conf"]
    return box.run([*argv, *args]).stdout


def _ticks(box: Container) -> List[Tuple[int, float]]:
    try:
        text = box.path(f"/home/{USER}/ticks").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((int(parts[0]), float(parts[1])))
    return out


def trial(box: Container, ran: float) -> Dict[str, float]:
    """One job, one restart: the figures."""
    box.run(["rm", "-f", f"/home/{USER}/ticks"])
    job = json.loads(_client(box, "submit", "--json", "--", "/usr/bin/python3", f"{SRV}/ticker.py"))["id"]
    first = wait_for(lambda: _ticks(box), 30, "the job's first tick")
    pid, began = first[0]
    time.sleep(max(0.0, began + ran - time.time()))
    restarted = time.time()
    box.run(["systemctl", "restart", UNIT], timeout=120)

    def again():
        ticks = [t for t in _ticks(box) if t[1] > restarted + 0.5]
        return ticks if ticks else None

    wait_for(again, 60, "a tick after the restart", interval=0.05)
    ticks = _ticks(box)
    times = [t for _p, t in ticks]
    gap = max((b - a for a, b in zip(times, times[1:]) if b > restarted - 1), default=0.0)
    survived = all(p == pid for p, _t in ticks)
    listed = json.loads(_client(box, "jobs", "--json", "--all"))["jobs"]
    restarts = next(j["restarts"] for j in listed if j["id"] == job)
    _client(box, "cancel", str(job))
    wait_for(
        lambda: any(
            j["id"] == job and j["state"] == "cancelled"
            for j in json.loads(_client(box, "jobs", "--json", "--all"))["jobs"]
        ),
        30,
        "the job cancelled",
    )
    lost = 0.0 if survived else restarted - began
    return {"survived": float(survived), "lost": lost, "gap": gap, "restarts": float(restarts)}


def measure(name: str, code: Path, work: Path, trials: int, ran: float) -> Dict[str, object]:
    rows = []
    with booted(code, work) as box:
        for _ in range(trials):
            rows.append(trial(box, ran))
    return {
        "version": name,
        "survived": f"{sum(int(r['survived']) for r in rows)}/{len(rows)}",
        "lost": statistics.median(r["lost"] for r in rows),
        "gap": statistics.median(r["gap"] for r in rows),
        "gap_max": max(r["gap"] for r in rows),
        "restarts": max(r["restarts"] for r in rows),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--baseline", default=DEFAULT_BASELINE, help="git ref to measure side by side ('' for none)"
    )
    p.add_argument("--trials", type=int, default=3, help="restarts per version")
    p.add_argument("--ran", type=float, default=5.0, help="seconds the job runs before each restart")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("restart.py: needs root (it boots a container with systemd-nspawn)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-mon-restart-") as tmp:
        work = Path(tmp)
        versions = [("this checkout", ROOT)]
        if a.baseline:
            versions.append(
                (f"baseline {a.baseline}", bg.extract_ref(ROOT, a.baseline, work / "baseline-code"))
            )
        results = []
        for i, (name, code) in enumerate(versions):
            (work / f"v{i}").mkdir()
            results.append(measure(name, code, work / f"v{i}", a.trials, a.ran))
    print(f"\nOne `systemctl restart gpu-mon`, a queued job {a.ran:g} s into its run, {a.trials} trials:\n")
    print(
        "| version | run survived | run time lost (median) | the job's gap, median / max | restarts after |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['version']} | {r['survived']} | {r['lost']:.1f} s | {r['gap']:.2f} / {r['gap_max']:.2f} s "
            f"| {r['restarts']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
