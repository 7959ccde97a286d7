"""`gpu-mon share` (Slurm's sshare): each user's use of the queue's GPUs over [queue] fair_window_hours, their
place in the order jobs take GPUs (placement.users_in_order, the order placement itself follows), and what
they have queued, held and running. Pure: the jobs in, a JSON-able answer out."""

from __future__ import annotations

from collections import Counter
from typing import Dict, Optional, Sequence

from gpu_mon.config import QueueSection
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.placement import users_in_order


def table(jobs: Sequence[Job], q: QueueSection, wall: float, only: Optional[str] = None) -> dict:
    """`{"order": "fair", "window_hours": 24, "users": [...]}`: a line per user who used GPUs in the window or
    has jobs not ended, by place (users with nothing queued last, by usage); `only`: that user's line
    alone (the admin keeps the table to root: share_public = no)."""
    order, usage = users_in_order(jobs, q, wall)
    place = {u: i + 1 for i, u in enumerate(order)}
    counts: Dict[str, Counter] = {}
    for j in jobs:
        if j.state not in J.ENDED:
            c = counts.setdefault(j.user, Counter())
            c[j.state] += 1
            if j.state in J.LIVE:
                c["gpus"] += len(j.gpus)
    names = set(usage) | set(counts)
    rows = [
        {
            "user": u,
            "gpu_hours": round(usage.get(u, 0.0) / 3600, 4),
            "gpu_seconds": round(usage.get(u, 0.0), 1),  # (what the order compares)
            "place": place.get(u),
            "queued": counts.get(u, Counter())[J.QUEUED],
            "held": counts.get(u, Counter())[J.HELD],
            "running": sum(counts.get(u, Counter())[s] for s in J.LIVE),
            "gpus_running": counts.get(u, Counter())["gpus"],
        }
        for u in names
        if only is None or u == only
    ]
    rows.sort(key=lambda r: (r["place"] is None, r["place"] or 0, r["gpu_seconds"], r["user"]))
    return {"order": q.order, "window_hours": q.fair_window_hours, "users": rows, "everyone": only is None}
