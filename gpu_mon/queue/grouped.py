"""A line of `jobs` for an array's elements in one state (collapsed): what all of them share, else
totals, unions and ranges, never one element's value as the group's.

- GPUs: the union of the elements' GPUs (sorted by index); RESTARTS: the total of the elements' restarts.
- started, run_seconds, ran_seconds, exit status and signal, submitted, priority: the shared value, else
  null, with `started_range` / `run_seconds_range` / `ran_seconds_range` ([shortest, longest]) for TIME.
- ended: the latest (the group ended when its last element did); preempted: the latest preemption, with its
  reason.
- reason: the shared one, else the first element's, named as its own (`22_0: waiting: 3 jobs ahead (the
  others differ)`).
- first_exit_status: the first element's (lowest index), for `wait`'s "the first failure's status".
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import iso, ran_in_all, run_seconds

# the fields shown only when every element has the same: (JSON key, the value, as JSON has it)
_SHARED: Tuple[Tuple[str, Callable[[Job], object], Callable[[object], object]], ...] = (
    ("started", lambda j: j.started, lambda v: iso(v)),  # type: ignore[arg-type]
    ("run_seconds", run_seconds, lambda v: v),
    ("ran_seconds", ran_in_all, lambda v: v),
    ("exit_status", lambda j: j.exit_status, lambda v: v),
    ("signal", lambda j: j.signal or None, lambda v: v),
    ("submitted", lambda j: j.submitted, lambda v: iso(v)),  # type: ignore[arg-type]
    ("priority", lambda j: j.priority, lambda v: v),
)


def grouped(
    first: dict,
    members: Sequence[Job],
    index_of: Dict[str, int],
    reason_key: Callable[[Job], object],
) -> dict:
    """The group's JSON object, from its first element's (`first`, as `jobs` lists it) and every element.
    reason_key: what decides an element's reason (equal keys, equal reasons)."""
    head = members[0]
    group = dict(first)
    alike, group["restarts"] = _alike(members)
    if head.state in J.LIVE:
        group["gpus"], group["gpu_indices"] = _gpus(alike, index_of)
    for key, get, shown in _SHARED:
        value = get(head)
        if any(get(m) != value for m in alike):
            group[key] = None
        else:
            group[key] = shown(value)
    _ranges(group, alike)
    ends = [m.ended for m in alike if m.ended is not None]
    group["ended"] = iso(max(ends)) if ends else None
    preempted = [m for m in alike if m.preempted_at is not None]
    if preempted:
        last = max(preempted, key=lambda m: m.preempted_at or 0.0)
        group["preempted"], group["preempted_reason"] = iso(last.preempted_at), last.preempted_reason
    group["first_exit_status"] = head.exit_status
    key = reason_key(head)
    if any(reason_key(m) != key for m in members):
        group["reason"] = f"{head.array_id}_{head.array_index}: {first['reason']} (the others differ)"
    return group


def _alike(members: Sequence[Job]) -> Tuple[List[Job], int]:
    """The members whose values can differ (every one changed since its submit, and one of each array's
    still as submitted: those have every value alike but id and index, jobs.as_submitted), and the
    members' restarts in all. Unions, ranges, latest and "all the same" read the same from these as from
    every member (a 10 000-element group: 12 -> 3 ms)."""
    alike: List[Job] = []
    kinds: Dict[type, List[Job]] = {}
    for m in members:
        if J.as_submitted(m):
            kinds.setdefault(type(m), []).append(m)
        else:
            alike.append(m)
    restarts = sum(m.restarts for m in alike) + sum(len(ms) * ms[0].restarts for ms in kinds.values())
    return alike + [ms[0] for ms in kinds.values()], restarts


def _gpus(members: Sequence[Job], index_of: Dict[str, int]) -> Tuple[List[str], List[Optional[int]]]:
    """Every element's GPUs, each once, in the order of their indices (unknown ones last)."""
    pairs = {(index_of.get(u), u) for m in members for u in m.gpus}
    ordered = sorted(pairs, key=lambda p: (p[0] is None, p[0] or 0, p[1]))
    return [u for _, u in ordered], [i for i, _ in ordered]


def _ranges(group: dict, members: Sequence[Job]) -> None:
    """`started_range` (live) or `run_seconds_range` (ended) when the elements' differ: [first, last]."""
    if group["started"] is None and members[0].state in J.LIVE:
        starts = [m.started for m in members if m.started is not None]
        if starts:
            group["started_range"] = [iso(min(starts)), iso(max(starts))]
    for key, of in (("run_seconds", run_seconds), ("ran_seconds", ran_in_all)):
        if group[key] is None:
            runs = [s for s in map(of, members) if s is not None]
            if runs:
                group[f"{key}_range"] = [min(runs), max(runs)]
