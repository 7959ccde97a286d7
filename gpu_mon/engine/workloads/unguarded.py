"""Bounded time without a guard: jobs' transient units outlive gpu-mon (a restart, an upgrade, a crash costs
them nothing), but while gpu-mon is away nobody yields their GPUs. So the moment gpu-mon is gone, a timer of
systemd's own is armed: `gpu-mon-unguarded.timer`, which after `[queue] unguarded_seconds` (default 120)
runs `systemctl stop 'gpu-mon-job-*.service'`: each job gets its stop signal and grace from systemd (its
unit's KillSignal= and TimeoutStopSec=), and the gpu-mon that comes back finds them stopped by systemd
(ends.py's mark) and puts them back in the queue. A gpu-mon that comes back in time disarms it once it has
found its jobs again (and once more when the last leader of the old daemon is gone: it may have armed the
timer after the first disarm).

Who arms it: each job's leader (leader.py), when the kernel tells it that the daemon died (an orderly stop,
a crash, the watchdog's SIGKILL alike), before it lets go of the unit. The first leader's arming wins; the
others find the timer there and leave it. Nothing here needs gpu-mon to be running.

Standard library only: the leader imports it.
"""

from __future__ import annotations

import subprocess
from typing import List

UNIT = "gpu-mon-unguarded"
JOBS = "gpu-mon-job-*.service"
_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_TIMEOUT = 10.0


def arm_argv(seconds: float) -> List[str]:
    """The `systemd-run` that arms the guard: a transient timer, gone once it has fired (never left in the
    way of the next arming), whose service stops every job's unit."""
    return [
        "systemd-run",
        "--quiet",
        f"--unit={UNIT}",
        f"--on-active={max(1, int(seconds + 0.999))}s",
        "--timer-property=AccuracySec=1s",
        "--timer-property=RemainAfterElapse=no",
        "--collect",
        "--description=gpu-mon is away: stop the queue's jobs (gpu-mon-unguarded)",
        "--",
        "systemctl",
        "stop",
        JOBS,
    ]


def disarm_argv() -> List[str]:
    """The `systemctl` that disarms it (and ends a guard's stop still under way: the jobs it has not
    stopped yet keep running)."""
    return ["systemctl", "stop", f"{UNIT}.timer", f"{UNIT}.service"]


def arm(seconds: float) -> bool:
    """Arm it (the leader, as the daemon died); whether it is armed now (by this call or an earlier one)."""
    try:
        done = subprocess.run(
            arm_argv(seconds),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=_ENV,
            timeout=_TIMEOUT,
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 or b"already" in done.stderr
