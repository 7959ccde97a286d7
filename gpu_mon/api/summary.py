"""What the history says about a period: per GPU, per process, per user, per day. Pure functions on what
api/historydb.py reads; `gpu-mon report` renders them, and Python users may call `summarize` directly.

Every second of the period is in exactly one of a GPU's five states; time the history does not cover (no
daemon was running) counts as unknown, so the five durations add up to the period.
"""

from __future__ import annotations

import bisect
import datetime
import math
from typing import Dict, List, Optional, Sequence, Tuple

from gpu_mon.api import historydb

STATES = ("harvesting", "foreign", "idle", "paused", "unknown")


def percentile(values: Sequence[float], pct: float) -> Optional[float]:
    """Nearest-rank percentile, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * pct / 100) - 1)]


def gpu_rows(
    gpus: List[Tuple[str, Optional[int], Optional[str]]],
    spans: List[historydb.Span],
    yields: List[Tuple[float, str, float]],
    since: float,
    until: float,
) -> List[dict]:
    """One row per GPU: seconds in each state, preemptions and yield latency (open to SIGTERM)."""
    out = []
    by_gpu: Dict[str, List[historydb.Span]] = {}
    for s in spans:
        by_gpu.setdefault(s.key, []).append(s)
    for uuid, index, name in gpus:
        seconds = dict.fromkeys(STATES, 0.0)
        for s in by_gpu.get(uuid, ()):
            seconds[s.kind if s.kind in seconds else "unknown"] += s.within(since, until)
        seconds["unknown"] += max(0.0, (until - since) - sum(seconds.values()))
        ms = [t for _time, u, t in yields if u == uuid]
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        out.append(
            {
                "uuid": uuid,
                "index": index,
                "name": name,
                **{
                    f"{'harvested' if k == 'harvesting' else k}_seconds": round(v, 1)
                    for k, v in seconds.items()
                },
                "preemptions": len(ms),
                "yield_ms_p50": round(p50, 1) if p50 is not None else None,
                "yield_ms_p99": round(p99, 1) if p99 is not None else None,
            }
        )
    return out


def process_rows(
    runs: List[Tuple[str, str, int, str, float, float]], since: float, until: float
) -> List[dict]:
    """Runs and GPU-seconds per [process-*] section."""
    out: Dict[str, dict] = {}
    for process, _label, ngpus, _user, start, end in runs:
        row = out.setdefault(process, {"name": process, "runs": 0, "gpu_seconds": 0.0})
        row["runs"] += 1
        row["gpu_seconds"] += ngpus * max(0.0, min(end, until) - max(start, since))
    return sorted(
        ({**r, "gpu_seconds": round(r["gpu_seconds"], 1)} for r in out.values()), key=lambda r: r["name"]
    )


def user_rows(
    spans: List[historydb.Span], idle: List[historydb.Span], since: float, until: float
) -> List[dict]:
    """GPU-seconds per user (foreign use, and our workloads' users) and seconds as an idle holder."""
    out: Dict[str, dict] = {}

    def row(user: str) -> dict:
        return out.setdefault(user, {"user": user, "gpu_seconds": 0.0, "idle_holder_seconds": 0.0})

    for s in spans:
        if s.kind in ("foreign", "harvesting"):
            for user in filter(None, s.detail.split(",")):
                row(user)["gpu_seconds"] += s.within(since, until)
    for e in idle:
        row(e.key)["idle_holder_seconds"] += e.within(since, until)
    return sorted(
        ({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in out.values()),
        key=lambda r: (-r["gpu_seconds"], r["user"]),
    )


def day_rows(spans: List[historydb.Span], since: float, until: float) -> List[dict]:
    """Per local calendar day: seconds in each state, all GPUs together (the covered time only)."""
    first = datetime.datetime.fromtimestamp(since).replace(hour=0, minute=0, second=0, microsecond=0)
    bounds = [first]
    while bounds[-1].timestamp() < until:
        bounds.append(bounds[-1] + datetime.timedelta(days=1))
    edges = [b.timestamp() for b in bounds]
    totals = [dict.fromkeys(STATES, 0.0) for _ in edges[:-1]]
    for s in spans:  # each span visits only the days it touches
        i = max(0, bisect.bisect_right(edges, max(s.start, since)) - 1)
        while i < len(totals) and edges[i] < min(s.end, until):
            kind = s.kind if s.kind in STATES else "unknown"
            totals[i][kind] += s.within(max(since, edges[i]), min(until, edges[i + 1]))
            i += 1
    return [
        {"day": bounds[i].date().isoformat(), **{f"{k}_seconds": round(v, 1) for k, v in t.items()}}
        for i, t in enumerate(totals)
    ]


def summarize(conn: object, since: float, until: float) -> dict:
    """The whole report of [since, until) (the JSON of `gpu-mon report --json`)."""
    spans = historydb.intervals(conn, since, until)  # type: ignore[arg-type]
    return {
        "since": _iso(since),
        "until": _iso(until),
        "gpus": gpu_rows(
            historydb.gpus(conn), spans, historydb.preemptions(conn, since, until), since, until
        ),  # type: ignore[arg-type]
        "processes": process_rows(historydb.runs(conn, since, until), since, until),  # type: ignore[arg-type]
        "users": user_rows(spans, historydb.idle_episodes(conn, since, until), since, until),  # type: ignore[arg-type]
        "days": day_rows(spans, since, until),
    }


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall).astimezone().isoformat(timespec="seconds")
