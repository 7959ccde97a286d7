"""What the history says about a period: per GPU, per process, per user, per day. Pure functions on what
api/historydb.py reads; `gpu-mon report` renders them, and Python users may call `summarize` directly.

Every second of the period is in exactly one of a GPU's five columns (COLUMNS); time the history does not
cover (no daemon was recording) counts as unknown, and is also given apart as `not_recorded`, so the five
durations add up to the period. The per-GPU rows, the per-day rows and the total are sums of the same
cells (one per GPU and day), so they agree to the second.
"""

from __future__ import annotations

import bisect
import datetime
import math
from typing import Dict, List, Optional, Sequence, Tuple

from gpu_mon.api import historydb

STATES = ("harvesting", "foreign", "idle", "paused", "unknown")  # as the history records them
COLUMNS = ("harvested", "foreign", "idle", "paused", "unknown")  # as reports name them, in that order
NOT_RECORDED = "not_recorded"  # the part of unknown with no record at all
_COLUMN = dict(zip(STATES, COLUMNS))
Cells = List[Dict[str, Dict[str, float]]]  # per bin, per GPU uuid: column (and NOT_RECORDED) -> seconds


def percentile(values: Sequence[float], pct: float) -> Optional[float]:
    """Nearest-rank percentile, or None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * pct / 100) - 1)]


def day_edges(since: float, until: float) -> List[float]:
    """since, every local midnight after it and before until, until: the bins of the per-day rows."""
    return _edges(since, until, datetime.timedelta(days=1), lambda d: d.replace(hour=0, minute=0))


def hour_edges(since: float, until: float, minutes: int = 60) -> List[float]:
    """since, every `minutes` of the local clock (a divisor of 60) after it and before until, until."""
    return _edges(
        since,
        until,
        datetime.timedelta(minutes=minutes),
        lambda d: d.replace(minute=d.minute // minutes * minutes),
    )


def _edges(since: float, until: float, step: datetime.timedelta, floor) -> List[float]:
    mark = floor(datetime.datetime.fromtimestamp(since).replace(second=0, microsecond=0))
    edges = [since]
    while True:
        mark += step  # local wall-clock steps: a day is 23 or 25 h across a DST change
        t = mark.timestamp()
        if t >= until:
            return [*edges, until]
        if t > edges[-1]:
            edges.append(t)


def cells(uuids: Sequence[str], spans: List[historydb.Span], edges: Sequence[float]) -> Cells:
    """Seconds in each column per bin [edges[i], edges[i+1]) and GPU; a GPU's time in a bin that no span
    covers is unknown and not recorded. Spans of GPUs not in `uuids` are left out."""
    out: Cells = [{u: dict.fromkeys((*COLUMNS, NOT_RECORDED), 0.0) for u in uuids} for _ in edges[:-1]]
    known = set(uuids)
    for s in spans:  # each span visits only the bins it touches
        if s.key not in known:
            continue
        column = _COLUMN.get(s.kind, "unknown")
        i = max(0, bisect.bisect_right(edges, s.start) - 1)
        while i < len(out) and edges[i] < s.end:
            out[i][s.key][column] += s.within(edges[i], edges[i + 1])
            i += 1
    for i, row in enumerate(out):
        for seconds in row.values():
            missing = max(0.0, (edges[i + 1] - edges[i]) - sum(seconds[c] for c in COLUMNS))
            seconds["unknown"] += missing
            seconds[NOT_RECORDED] += missing
    return out


def _sum(parts: Sequence[Dict[str, float]]) -> Dict[str, float]:
    total = dict.fromkeys((*COLUMNS, NOT_RECORDED), 0.0)
    for p in parts:
        for k in total:
            total[k] += p[k]
    return total


def _seconds(totals: Dict[str, float]) -> Dict[str, float]:
    return {f"{k}_seconds": round(v, 1) for k, v in totals.items()}


def _latency(ms: List[float]) -> dict:
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    return {
        "preemptions": len(ms),
        "yield_ms_p50": round(p50, 1) if p50 is not None else None,
        "yield_ms_p99": round(p99, 1) if p99 is not None else None,
    }


def gpu_rows(
    gpus: List[Tuple[str, Optional[int], Optional[str]]],
    grid: Cells,
    yields: List[Tuple[float, str, float]],
) -> List[dict]:
    """One row per GPU: seconds in each column over all bins, preemptions and yield latency (open to
    SIGTERM)."""
    out = []
    for uuid, index, name in gpus:
        ms = [t for _time, u, t in yields if u == uuid]
        row = {"uuid": uuid, "index": index, "name": name}
        out.append({**row, **_seconds(_sum([r[uuid] for r in grid])), **_latency(ms)})
    return out


def day_rows(grid: Cells, edges: Sequence[float], yields: List[Tuple[float, str, float]]) -> List[dict]:
    """Per bin (a local calendar day for `report`): seconds in each column, all GPUs together, and the
    preemptions in it."""
    times = [t for t, _u, _ms in yields]
    return [
        {
            "day": datetime.datetime.fromtimestamp(edges[i]).date().isoformat(),
            **_seconds(_sum(list(row.values()))),
            "preemptions": bisect.bisect_left(times, edges[i + 1]) - bisect.bisect_left(times, edges[i]),
        }
        for i, row in enumerate(grid)
    ]


def total_row(grid: Cells, yields: List[Tuple[float, str, float]]) -> dict:
    """All GPUs over the whole period: what the per-GPU rows and the per-day rows both add up to."""
    return {
        **_seconds(_sum([s for row in grid for s in row.values()])),
        **_latency([ms for _t, _u, ms in yields]),
    }


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


# per job, and per user as job_*; energy: of the runs that ended in the period (a run's energy is known
# whole, at its end), and how many of them have no figure (a GPU without NVML's counter or power)
JOB_FIGURES = ("runs", "gpu_seconds", "preemptions", "wait_seconds", "energy_kwh", "energy_runs_unknown")
MJ_PER_KWH = 3.6e9


def _job_figures(run: historydb.JobRunRow, since: float, until: float) -> Dict[str, float]:
    """What one run adds: GPU-seconds inside the period; its preemption, when it ended so inside it; its
    wait, when it started inside it; its energy, when it ended inside it."""
    ended = run.how != "running" and since <= run.end < until
    return {
        "runs": 1,
        "gpu_seconds": run.gpus * max(0.0, min(run.end, until) - max(run.start, since)),
        "preemptions": int(run.how == "preempted" and since <= run.end < until),
        "wait_seconds": run.wait if since <= run.start < until else 0.0,
        "energy_kwh": run.energy_mj / MJ_PER_KWH if ended and run.energy_mj is not None else 0.0,
        "energy_runs_unknown": int(ended and run.energy_mj is None),
    }


def job_rows(runs: List[historydb.JobRunRow], since: float, until: float) -> List[dict]:
    """Per queued job: its runs in the period, their GPU-seconds, preemptions (and why each, naming who:
    `preempted_by`, in order) and waits (queued time before each start), and how its last run ended
    (`running` while it runs)."""
    out: Dict[Tuple[object, float], dict] = {}
    for run in runs:  # (by start: the last one wins `last`)
        row = out.setdefault(
            (run.job, run.submitted),
            {
                "job": run.job,
                "user": run.user,
                "name": run.name,
                **dict.fromkeys(JOB_FIGURES, 0),
                "preempted_by": [],
            },
        )
        figures = _job_figures(run, since, until)
        for key, value in figures.items():
            row[key] += value
        if figures["preemptions"]:
            row["preempted_by"].append(run.preempted_by or "?")
        row["last"] = run.how
    return [_rounded(r) for r in sorted(out.values(), key=lambda r: (_job_order(r["job"]), r["user"]))]


def _job_order(job: object) -> Tuple[int, int]:
    """Jobs in the order of their ids, an array's elements (`17_5`) at their array's, by index."""
    head, _, index = str(job).partition("_")
    try:
        return int(head), int(index) if index else -1
    except ValueError:  # (not written by gpu-mon)
        return 0, -1


def _rounded(row: dict) -> dict:
    """Seconds to a tenth; kWh to 6 places (a short job's is a few Wh)."""
    return {
        k: round(v, 6 if k.endswith("_kwh") else 1) if isinstance(v, float) else v for k, v in row.items()
    }


def user_rows(
    spans: List[historydb.Span],
    idle: List[historydb.Span],
    since: float,
    until: float,
    runs: Sequence[historydb.JobRunRow] = (),
) -> List[dict]:
    """GPU-seconds per user (foreign use, and our workloads' and jobs' users), seconds as an idle holder,
    and their queued jobs' figures (job_runs, job_gpu_seconds, job_preemptions, job_wait_seconds)."""
    out: Dict[str, dict] = {}
    jobs: Dict[str, set] = {}

    def row(user: str) -> dict:
        empty = {"user": user, "gpu_seconds": 0.0, "idle_holder_seconds": 0.0, "jobs": 0}
        return out.setdefault(user, {**empty, **{f"job_{k}": 0 for k in JOB_FIGURES}})

    for s in spans:
        if s.kind in ("foreign", "harvesting"):
            for user in filter(None, s.detail.split(",")):
                row(user)["gpu_seconds"] += s.within(since, until)
    for e in idle:
        row(e.key)["idle_holder_seconds"] += e.within(since, until)
    for run in runs:
        r = row(run.user)
        for key, value in _job_figures(run, since, until).items():
            r[f"job_{key}"] += value
        jobs.setdefault(run.user, set()).add((run.job, run.submitted))
        r["jobs"] = len(jobs[run.user])
    return sorted((_rounded(r) for r in out.values()), key=lambda r: (-r["gpu_seconds"], r["user"]))


def summarize(conn: object, since: float, until: float) -> dict:
    """The whole report of [since, until) (the JSON of `gpu-mon report --json`)."""
    spans = historydb.intervals(conn, since, until)  # type: ignore[arg-type]
    gpus = historydb.gpus(conn)  # type: ignore[arg-type]
    yields = historydb.preemptions(conn, since, until)  # type: ignore[arg-type]
    edges = day_edges(since, until)
    grid = cells([g[0] for g in gpus], spans, edges)
    runs = historydb.job_runs(conn, since, until)  # type: ignore[arg-type]
    return {
        "since": _iso(since),
        "until": _iso(until),
        "gpus": gpu_rows(gpus, grid, yields),
        "processes": process_rows(historydb.runs(conn, since, until), since, until),  # type: ignore[arg-type]
        "users": user_rows(spans, historydb.idle_episodes(conn, since, until), since, until, runs),  # type: ignore[arg-type]
        "jobs": job_rows(runs, since, until),
        "days": day_rows(grid, edges, yields),
        "total": total_row(grid, yields),
    }


def _iso(wall: float) -> str:
    return datetime.datetime.fromtimestamp(wall).astimezone().isoformat(timespec="seconds")
