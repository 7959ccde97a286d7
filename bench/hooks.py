"""What a flood of notices costs the daemon's loop: one user's N jobs end at once (a --notify-each array
cancelled), each with a hook, and another user's one job just after.

    sudo python bench/hooks.py [--notices 1000]

Baseline, measured in the same run: every hook started in one look (as gpu-mon did before hooks took
turns). With turns (queue/hooks.py: MAX_STARTS a look, MAX_RUNNING at once, MAX_PER_USER of a user's): the
longest look, the time until the other user's hook starts, and until every hook has run. The hooks are
real (`/bin/sh -c true` as root and as nobody, through the same wrapper); the loop looks every
TURN_SECONDS while hooks wait, POLL_SECONDS while they only run, as the daemon does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_mon.queue import hooks
from gpu_mon.queue.jobs import Job

NOBODY = 65534


def _notice(job_id: int, uid: int) -> hooks.Notice:
    job = Job(
        id=job_id,
        user=str(uid),
        uid=uid,
        gid=uid,
        command=("true",),
        cwd="/",
        env=(),
        output="",
        submitted=0.0,
        notify=("true",),
    )
    return hooks.Notice(job, "cancelled", None)


def _hooks() -> hooks.Hooks:
    keep: Dict[int, object] = {}
    return hooks.Hooks(lambda j: os.devnull, lambda u, g: (g,), lambda j, t: True, keep)


def all_at_once(n: int) -> Dict[str, float]:
    """The baseline: every hook started in the loop's one look."""
    h = _hooks()
    began = time.perf_counter()
    for i in range(n):
        h._start(_notice(i, 0), "true", time.monotonic())
    h._start(_notice(n, NOBODY), "true", time.monotonic())
    look = time.perf_counter() - began
    most = len(h.running)
    h.close()
    return {"longest_look_ms": look * 1000, "other_user_ms": look * 1000, "all_ms": look * 1000, "most": most}


def in_turns(n: int) -> Dict[str, float]:
    """Hooks as the daemon runs them now: added, then a look every POLL_SECONDS until none is left."""
    h = _hooks()
    began = time.perf_counter()
    for i in range(n):
        h.add(_notice(i, 0), time.monotonic())
    h.add(_notice(n, NOBODY), time.monotonic())
    looks: List[float] = []
    other: Optional[float] = None
    most = 0
    while h.running or h.waiting:
        t = time.perf_counter()
        h.poll(time.monotonic())
        looks.append(time.perf_counter() - t)
        most = max(most, len(h.running))
        if other is None and any(r.job.uid == NOBODY for r in h.running):
            other = time.perf_counter() - began
        time.sleep(hooks.TURN_SECONDS if h.waiting else hooks.POLL_SECONDS)
    done = time.perf_counter() - began
    h.close()
    return {
        "longest_look_ms": max(looks) * 1000,
        "other_user_ms": (other or 0) * 1000,
        "all_ms": done * 1000,
        "most": most,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notices", type=int, default=1000, help="one user's hooks at once (default 1000)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/hooks.py: run as root (hooks run as another user)", file=sys.stderr)
        return 2
    base, now = all_at_once(args.notices), in_turns(args.notices)
    print(f"{args.notices} notices of one user, then 1 of another (real hooks: /bin/sh -c true)")
    print(f"{'':34}{'all at once (before)':>22}{'in turns (now)':>18}")
    rows = [
        ("longest look of the loop", "longest_look_ms", "{:.0f} ms"),
        ("until the other user's hook runs", "other_user_ms", "{:.0f} ms"),
        ("until every hook has run", "all_ms", "{:.0f} ms"),
        ("hooks running at once, at most", "most", "{:.0f}"),
    ]
    for label, key, fmt in rows:
        print(f"{label:34}{fmt.format(base[key]):>22}{fmt.format(now[key]):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
