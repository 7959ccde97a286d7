"""The queue's typed decisions in words, as `jobs` shows them (in the words `status` uses for workloads)."""

from __future__ import annotations

import time
from typing import Callable, Dict

from gpu_mon.api.text import sanitize
from gpu_mon.policy import words
from gpu_mon.queue.afterspec import AFTERANY, AFTERNOTOK
from gpu_mon.queue.placement import CancelJob, Waiting

_AFTER = {AFTERANY: " ends (afterany)", AFTERNOTOK: " ends without success (afternotok)"}


def _gpu(uuid: str, index_of: Dict[str, int]) -> str:
    index = index_of.get(uuid)
    return f"GPU {index}" if index is not None else uuid


def waiting(w: Waiting, user: str, index_of: Dict[str, int], now: float) -> str:
    """`waiting: GPU 1 busy: bob python3[4242] holds /dev/nvidia1`, `waiting: after job 16`, ..."""
    return "waiting: " + _why(w, user, index_of, now)


def _why(w: Waiting, user: str, index_of: Dict[str, int], now: float) -> str:
    if w.kind == "busy":
        return f"{_gpu(w.gpu, index_of)} busy: {words.reason(w.reason) if w.reason else 'unsure'}"
    if w.kind == "after":
        return f"after job {w.after}{_AFTER.get(w.after_kind, '')}"
    if w.kind == "running_limit":
        return f"{sanitize(user)} has {_running(w.count, w.starting)} (limit {w.limit})"
    if w.kind == "gpu_limit":
        return f"{sanitize(user)} has {w.count} GPUs (limit {w.limit})"
    if w.kind == "array_limit":
        return f"{w.count} of its array running (limit %{w.limit})"
    if w.kind == "ahead":
        return f"{w.count} job{'s' if w.count != 1 else ''} ahead"
    if w.kind == "start_delay":
        return f"GPU free, starting in {words.duration(max(0.0, (w.until or now) - now))}"
    if w.kind == "kept":
        return f"{_gpu(w.gpu, index_of)} kept for job {w.by_job}"
    if w.kind == "taken" and w.by_job:
        return f"{_gpu(w.gpu, index_of)} taken by job {w.by_job}"
    if w.kind in ("taken", "taken_for"):
        doing = "stopping" if w.kind == "taken_for" else "taken by"
        return f"{_gpu(w.gpu, index_of)} {doing} workload {sanitize(w.by_workload)}"
    if w.kind == "drained":
        return "queue drained"
    if w.kind == "too_many_gpus":
        return f"wants more GPUs than the queue has ({w.count})"
    if w.kind in ("over_job_limit", "over_user_limit"):
        return f"wants {w.count} GPUs, over the limit of {w.limit} per {w.kind.split('_')[1]}"
    return w.kind


def _running(count: int, starting: int) -> str:
    """`2 running`, `1 running and 1 starting` (placed, waiting out its start delay), `1 starting`."""
    running = count - starting
    if not starting:
        return f"{running} running"
    return f"{running} running and {starting} starting" if running else f"{starting} starting"


def refusal(w: Waiting, wanted: int) -> str:
    """Why `submit` refuses a job that could never start (sbatch refuses so): one line."""
    if w.kind == "too_many_gpus":
        gpus = f"{w.count} GPU{'s' if w.count != 1 else ''}"
        return f"--gpus {wanted}: the queue has {gpus}; the job could never start"
    return f"--gpus {wanted} is over the limit of {w.limit} per {w.kind.split('_')[1]}"


def drained(by: str, at: float) -> str:
    """`queue drained by root at 14:02: no job starts (gpu-mon queue resume)`, for `jobs` and `status` (a
    drain from before today: `at 2026-11-24 14:02`)."""
    today = time.strftime("%Y-%m-%d") == time.strftime("%Y-%m-%d", time.localtime(at))
    clock = time.strftime("%H:%M" if today else "%Y-%m-%d %H:%M", time.localtime(at))
    return f"queue drained by {sanitize(by)} at {clock}: no job starts (gpu-mon queue resume)"


def never_met(c: CancelJob, ref: Callable[[int], str]) -> str:
    """A dependency that can never be met, and why: `afterok:17 (job 17 failed)`, `afterok:20 (job 20_3
    cancelled)`, `afternotok:20 (every element of array 20 done)`, `afterany:9 (job 9 does not exist)`.
    ref: a job's number as users name it."""
    named = str(c.array) if c.array else ref(c.after)
    if not c.after_state:
        what = f"{'array' if c.array else 'job'} {named} does not exist"
    elif c.array and c.kind == AFTERNOTOK:
        what = f"every element of array {c.array} done"
    else:
        what = f"job {ref(c.after)} {c.after_state}"
    return f"{c.kind}:{named} ({what})"
