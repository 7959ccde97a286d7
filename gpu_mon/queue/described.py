"""A queued job as `jobs --json`, `show` and `status` describe it: its fields, the reason it waits (the
last placement's words, View), its GPUs' indices and its estimated start. No I/O."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Dict, Optional

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import command_json, iso, listed_reason, ran_in_all, run_seconds
from gpu_mon.queue.placement import Waiting
from gpu_mon.queue.words import waiting as waiting_words


@dataclass
class View:
    """What the daemon last decided, for `jobs`: waiting reasons and GPU indices."""

    waiting: Dict[int, Waiting] = dataclasses.field(default_factory=dict)
    index_of: Dict[str, int] = dataclasses.field(default_factory=dict)
    placed_up_to: int = 0  # the highest job id the last placement knew
    gpus: Optional[int] = None  # how many GPUs the queue had then (None: not placed yet)
    estimates: Dict[int, float] = dataclasses.field(default_factory=dict)  # queued job -> estimated start


def describe(j: Job, view: View, now: float, whole: bool = False) -> dict:
    """A job as `jobs --json` shows it (an array's element without its command: the listing's "arrays"
    has it, as `shared_of` says)."""
    indices = tuple(view.index_of.get(u) for u in j.gpus) if j.state in J.LIVE else ()
    return _described(j, listed_reason(reason_of(j, view, now), whole), indices, whole, estimate(j, view))


def estimate(j: Job, view: View) -> Optional[float]:
    """When a queued job is estimated to start (wall-clock; None: unknown, or not queued)."""
    return view.estimates.get(j.id) if j.state == J.QUEUED else None


def shared_of(j: Job, whole: bool = False) -> dict:
    """What an array's elements share, as a listing's "arrays" gives it under the array's id."""
    text, cut = command_json(j.command, whole)
    return {"command": json.loads(text), "command_cut": cut}


def reason_of(j: Job, view: View, now: float) -> str:
    """Why a queued job waits (the last placement's words), or why the job ended as it did."""
    if j.state == J.QUEUED and j.id in view.waiting:
        return waiting_words(view.waiting[j.id], j.user, view.index_of, now)
    if j.state == J.QUEUED and j.id > view.placed_up_to:
        return "waiting: just submitted"  # (the next placement, within 0.2 s, says more)
    if j.state == J.HELD:
        return "held"
    return j.reason


def reason_key(j: Job, view: View) -> object:
    """What decides reason_of(j) but its clock (equal keys: equal reasons), without making the words."""
    if j.state == J.QUEUED and j.id in view.waiting:
        return view.waiting[j.id]
    return (j.state, j.id > view.placed_up_to, j.reason)


def _described(
    j: Job, reason: str, indices: tuple, whole: bool = False, start: Optional[float] = None
) -> dict:
    live = j.state in J.LIVE
    command = {} if j.array_id else shared_of(j, whole)
    return {
        "id": j.id,
        "user": j.user,
        "name": j.name,
        "state": j.state,
        "reason": reason,
        "gpus": list(j.gpus) if live else [],
        "gpu_indices": list(indices),
        "estimated_start": iso(start),
        "gpus_wanted": j.gpus_wanted,
        "priority": j.priority,
        "submitted": iso(j.submitted),
        "started": iso(j.started),
        "ended": iso(j.ended),
        "restarts": j.restarts,
        "exit_status": j.exit_status,
        "signal": j.signal or None,
        "run_seconds": run_seconds(j),
        "ran_seconds": ran_in_all(j),
        "preempted": iso(j.preempted_at),
        "preempted_reason": listed_reason(j.preempted_reason, whole),
        **command,
        "array_id": j.array_id or None,
        "array_index": j.array_index if j.array_id else None,
    }
