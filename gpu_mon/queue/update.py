"""`gpu-mon update JOB` (Slurm's `scontrol update`): what a request asks to change, checked as a submit
checks it, and the change of one job (pure; requests.py finds the jobs and writes them).

A queued or held job may change its --priority (a plain user only lowers it, as in Slurm; root may raise
it), --time-limit (within [queue] max_time_limit), --gpus, --after and --name; a running one only its
--name and --time-limit (a plain user only lowers a running job's limit; anything else is refused,
naming it); an ended one nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from gpu_mon.config import QueueSection
from gpu_mon.queue import fields, timelimits
from gpu_mon.queue import jobs as J
from gpu_mon.queue.fields import MAX_NAME, Bad
from gpu_mon.queue.jobs import Job

# What may change, as the request names it, and as the user wrote it
OPTIONS = {"priority": "--priority", "time_limit": "--time-limit", "gpus": "--gpus", "after": "--after"}
OPTIONS["name"] = "--name"
WHILE_RUNNING = ("name", "time_limit")
MAX_WALK = 200_000  # jobs a check for a cycle of --after looks at, at most
TOP, LOW = fields.MAX_PRIORITY, -fields.MAX_PRIORITY


@dataclass(frozen=True)
class Change:
    """What an update asks (None: not asked); `after`: Job's dependency fields (J.DEPENDENCIES)."""

    priority: Optional[int] = None
    time_limit: Optional[float] = None
    gpus: Optional[int] = None
    after: Optional[Dict[str, Tuple[int, ...]]] = None
    name: Optional[str] = None

    def asked(self) -> List[str]:
        """The fields asked for, as the request names them."""
        return [k for k in OPTIONS if getattr(self, k) is not None]


def asked(
    req: dict,
    q: QueueSection,
    after: Callable[[object], Dict[str, Tuple[int, ...]]],
    could_start: Callable[[int], None],
) -> Change:
    """The request's change, each value checked as a submit checks it (Bad, one line): `after` parses
    --after (requests.Requests._after), `could_start` refuses a --gpus that could never fit."""
    change = Change(
        priority=_optional(req, "priority", lambda: fields.whole(req, "priority", "--priority", 0, LOW, TOP)),
        time_limit=_optional(req, "time_limit", lambda: _limit(req, q)),
        gpus=_optional(req, "gpus", lambda: fields.whole(req, "gpus", "--gpus", 1, 1, fields.MAX_GPUS)),
        after=_optional(req, "after", lambda: after(req.get("after") or [])),
        name=_optional(req, "name", lambda: fields.label(req, "name", "--name", MAX_NAME)),
    )
    if not change.asked():
        raise Bad("update: nothing to change (--priority, --time-limit, --gpus, --after or --name)")
    if change.gpus is not None:
        could_start(change.gpus)
    return change


def _optional(req: dict, key: str, read: Callable[[], object]) -> object:
    return read() if req.get(key) is not None else None


def _limit(req: dict, q: QueueSection) -> float:
    value = req.get("time_limit")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 366 * 86400:
        raise Bad("--time-limit must be a number of seconds, more than 0 (at most a year)")
    return timelimits.within_max(float(value), q)


def allowed(jobs: Iterable[Job], change: Change, admin: bool) -> None:
    """Bad (code 1) when the asker may not make this change to these jobs (their own, or root's): a plain
    user raising a job's priority (Slurm lets only an operator raise it), or a running job's time limit
    (the estimated starts of the jobs behind it count on it; a queued one's may go up to the maximum)."""
    if admin:
        return
    for j in jobs:
        _own_limit(j, change)
        if change.priority is not None and change.priority > j.priority and j.state not in J.ENDED:
            raise Bad(
                f"job {J.ref(j)}: only root may raise a job's priority (it has {j.priority}; "
                f"--priority {change.priority})",
                1,
            )


def _own_limit(j: Job, change: Change) -> None:
    raised = change.time_limit is not None and (j.time_limit is None or change.time_limit > j.time_limit)
    if raised and j.state in J.LIVE:
        now = "none" if j.time_limit is None else timelimits.span(j.time_limit)
        raise Bad(f"job {J.ref(j)} is running: only root may raise its time limit (it has {now})", 1)


def changed(job: Job, change: Change, waiting_only: bool = False) -> Job:
    """The job with the change made; Bad (one line) when its state does not allow it (waiting_only: an
    array's element that is not queued or held is left as it is: `update 17` changes the waiting ones)."""
    ref = J.ref(job)
    if job.state in J.ENDED:
        raise Bad(f"job {ref} has ended ({job.state}): nothing to update", 1)
    if job.state not in (J.QUEUED, J.HELD):
        if waiting_only:
            raise Bad(f"job {ref} is {job.state}", 1)
        fixed = [OPTIONS[k] for k in change.asked() if k not in WHILE_RUNNING]
        if fixed:
            which = ", ".join(fixed)
            raise Bad(
                f"job {ref} is {job.state}: {which} cannot change now (only --name and --time-limit can)", 1
            )
    values: Dict[str, object] = {}
    for key in ("priority", "time_limit", "name"):
        if getattr(change, key) is not None:
            values[key] = getattr(change, key)
    if change.gpus is not None:
        values["gpus_wanted"] = change.gpus
    if change.after is not None:
        values.update(change.after)
    new = dataclasses.replace(job, **values)  # type: ignore[arg-type]
    return job if all(getattr(new, k) == getattr(job, k) for k in values) else new


def cycle(
    job: Job,
    after: Dict[str, Tuple[int, ...]],
    get: Callable[[int], Optional[Job]],
    elements: Callable[[int], Sequence[Job]],
) -> Optional[int]:
    """The job of `after` (for `job`) that is the job, or waits (itself or through others) for it: a cycle
    no job of it would ever leave (an element waiting for its own whole array is one). None: no cycle."""
    for first in _named(after, get, elements):
        if _reaches(first, job.id, get, elements):
            return first.id
    return None


Get = Callable[[int], Optional[Job]]
Elements = Callable[[int], Sequence[Job]]


def _named(after: Dict[str, Tuple[int, ...]], get: Get, elements: Elements) -> List[Job]:
    """The jobs these dependency fields name (a whole array: its elements)."""
    out: List[Job] = []
    for key, ids in after.items():
        for i in ids:
            if key.endswith("_arrays"):
                out.extend(elements(i))
            else:
                j = get(i)
                out.extend([j] if j is not None else [])
    return out


def _reaches(start: Job, own: int, get: Get, elements: Elements) -> bool:
    """Whether `start` is the job `own`, or waits (through --after) for it."""
    todo, seen = [start], set()
    while todo and len(seen) < MAX_WALK:
        j = todo.pop()
        if j.id in seen:
            continue
        seen.add(j.id)
        if j.id == own:
            return True
        if j.state not in (J.QUEUED, J.HELD) or not J.depends(j):
            continue
        deps = {k: getattr(j, k) for k in J.DEPENDENCIES}
        todo.extend(d for d in _named(deps, get, elements) if d.id not in seen)
    return False
