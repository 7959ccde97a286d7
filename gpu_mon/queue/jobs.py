"""A queued job as plain data, and its state changes as small pure functions (each returns a new Job).

States: queued -> running -> stopping -> (done | failed | timeout | cancelled | preempted | queued again);
queued <-> held; queued/held -> cancelled. `ended` states never change again.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Type

QUEUED, HELD, RUNNING, STOPPING = "queued", "held", "running", "stopping"
DONE, FAILED, CANCELLED, PREEMPTED, TIMEOUT = "done", "failed", "cancelled", "preempted", "timeout"
STATES = (QUEUED, HELD, RUNNING, STOPPING, DONE, FAILED, CANCELLED, PREEMPTED, TIMEOUT)
ENDED = (DONE, FAILED, CANCELLED, PREEMPTED, TIMEOUT)
LIVE = (RUNNING, STOPPING)  # processes of it may run

# Why a running job is being stopped (what its end becomes)
STOP_PREEMPT, STOP_CANCEL, STOP_TIMEOUT, STOP_RESTART = "preempt", "cancel", "timeout", "restart"


@dataclass(frozen=True)
class Job:
    """One job: what the user submitted, and where it stands. `Job(...)` makes a job that holds its every
    field; an array's elements are of their array's own class (array_class), that holds what they share."""

    __slots__ = ()  # (the fields are kept by the subclasses: _Whole, or an array's)

    id: int
    user: str
    uid: int
    gid: int
    command: Tuple[str, ...]
    cwd: str
    env: Tuple[Tuple[str, str], ...]
    output: str
    submitted: float
    name: str = ""
    gpus_wanted: int = 1
    priority: int = 0
    after: Tuple[int, ...] = ()
    stop_signal: int = 15
    stop_main_only: bool = False  # the stop signal reaches only its main process (SIGTERM, SIGKILL: all)
    grace: float = 30.0
    time_limit: Optional[float] = None
    requeue: bool = True
    state: str = QUEUED
    gpus: Tuple[str, ...] = ()  # UUIDs while it runs (and the last ones after)
    started: Optional[float] = None
    ended: Optional[float] = None
    restarts: int = 0
    exit_status: Optional[int] = None
    signal: int = 0  # the signal that ended its last run (0: it exited; exit_status is 128 + it when not 0)
    reason: str = ""  # why it ended as it did, or why it is stopping (STOP_*)
    gpu_seconds: float = 0.0  # over all its runs that ended
    ran_seconds: float = 0.0  # its run time over all its runs that ended (0 in an older gpu-mon's rows)
    leader_pid: int = 0  # the leader of its current run, and its start ticks (for a daemon restart)
    leader_ticks: int = 0
    queued_at: Optional[float] = None  # when it last went back to the queue (None: waits since submitted)
    stopped_by: str = ""  # who cancelled it while it ran (with STOP_CANCEL)
    preempted_at: Optional[float] = None  # its last preemption (wall time), and why: `GPU 1 busy: ...`
    preempted_reason: str = ""
    array_id: int = 0  # an array's element: its array's id (the first element's job id), its index, and
    array_index: int = 0  # how many of the array's elements may run at once (0: any)
    array_limit: int = 0
    after_arrays: Tuple[int, ...] = ()  # --after a whole array: every element of these must be done
    notify: Tuple[str, ...] = ()  # --notify: the command run as the user when it ends (an array: its last)
    notify_each: bool = False  # an array's elements notify each
    # --after afterany:/afternotok: (`after` and `after_arrays` are afterok's): jobs, and whole arrays
    after_any: Tuple[int, ...] = ()  # ended, whatever the end
    after_any_arrays: Tuple[int, ...] = ()
    after_notok: Tuple[int, ...] = ()  # ended without success (failed, cancelled, preempted, timeout)
    after_notok_arrays: Tuple[int, ...] = ()

    @property
    def env_dict(self) -> Dict[str, str]:
        """The submitted environment."""
        return dict(self.env)

    def __new__(cls, *args: object, **kwargs: object) -> Job:
        return object.__new__(_Whole if cls is Job else cls)

    def __eq__(self, other: object) -> bool:
        """Field by field: an array's element (of its array's class, see array_class) equals a Job with
        the same values."""
        if not isinstance(other, Job):
            return NotImplemented
        return bool(_values(self) == _values(other))


class _Whole(Job):
    """A job that holds its every field (in its __dict__)."""


_Whole.__name__ = _Whole.__qualname__ = "Job"


FIELDS: Tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Job))
_FIELD_SET = frozenset(FIELDS)
_REQUIRED = frozenset(f.name for f in dataclasses.fields(Job) if f.default is dataclasses.MISSING)
_values = operator.attrgetter(*FIELDS)
# What an array's element holds itself (its index: from its id); the rest is its array's class's until it
# changes (array_class)
_OWN = ("id", "array_index")


def ref(job: Job) -> str:
    """How users name it: `17`, or `17_5` for an array's element (never its own number: an element's is
    its array's, or another job's to a reader). Every place a person reads names a job so."""
    return shown(job.id, job.array_id, job.array_index)


def shown(job_id: int, array_id: Optional[int], array_index: Optional[int]) -> str:
    """ref() from a job's fields as `jobs --json` and `status --json` give them (array_id null or 0: not
    an element)."""
    return f"{array_id}_{array_index}" if array_id else str(job_id)


class _Index:
    """An element's array_index, from its id: ids are given in the order of the array's indices, from the
    array's own id on (an element whose own value was read back from a row keeps that one instead)."""

    def __init__(self, first: int, indices: Sequence[int]) -> None:
        self.first, self.indices = first, indices

    def at(self, job_id: int) -> object:
        position = job_id - self.first
        return self.indices[position] if 0 <= position < len(self.indices) else _NONE

    def __get__(self, job: Optional[Job], cls: object = None) -> int:
        index = self.at(job.id) if job is not None else _NONE
        if index is _NONE:
            raise AttributeError("array_index")
        return index  # type: ignore[return-value]


def array_class(shared: Mapping[str, object], indices: Optional[Sequence[int]] = None) -> Type[Job]:
    """The class of an array's elements: a Job whose values in `shared` (what its elements were submitted
    with: every field but id and array_index) are class attributes. An element as submitted holds only
    its id (40 bytes, not its own copy of 40 fields: 2 KB); one that changed since is of a subclass that
    holds the fields that changed, too. With the array's indices (in the order of its ids, from the
    array's id on), an element's index is found from its id; without, each element keeps its own."""
    values = {k: v for k, v in shared.items() if k in _FIELD_SET and k not in _OWN}
    if indices is not None:
        values["array_index"] = _Index(int(shared["array_id"]), indices)  # type: ignore[call-overload]
    attrs = {"__module__": __name__, "__qualname__": "Job", "__new__": _element, "__init__": _made}
    cls = type("Job", (Job,), {**attrs, "__slots__": ("id",), **values})
    cls._changed = type("Job", (cls,), {"__module__": __name__, "__qualname__": "Job"})  # type: ignore
    cls._as_submitted = cls  # type: ignore[attr-defined]
    cls._needs = _REQUIRED - values.keys()  # type: ignore[attr-defined]
    return cls


def as_submitted(job: Job) -> bool:
    """Whether the job is an array's element unchanged since its submit: such elements of one array have
    every value alike but their id and index (those of their array's class)."""
    return getattr(type(job), "_as_submitted", None) is type(job)


def indices_of(cls: Type[Job]) -> Optional[Sequence[int]]:
    """The indices an array's class (array_class) was given, in the order of its elements' ids; None."""
    index = cls.__dict__.get("array_index")
    return index.indices if isinstance(index, _Index) else None


def holds_own(job: Job, name: str) -> bool:
    """Whether the job holds its own value of a field, not its array's class's (an element changed since
    its submit, in that field; a job not in an array holds every one)."""
    if getattr(type(job), "_as_submitted", None) is None:
        return True
    return name in getattr(job, "__dict__", {})


def values_of(job: Job) -> Dict[str, object]:
    """Every field of a job (what array_class takes)."""
    return dict(zip(FIELDS, _values(job)))


def _element(cls: Type[Job], **fields: object) -> Job:
    """An element made from values (dataclasses.replace, a row read back), whole here (`_made`): a value
    its array's class gives already (the same object, or equal and of the same type) is not kept again;
    one with no other value than those is an element as submitted."""
    base = cls._as_submitted  # type: ignore[attr-defined]
    missing, unknown = base._needs - fields.keys(), fields.keys() - _FIELD_SET
    if missing or unknown:
        raise TypeError(f"an array's element: missing {sorted(missing)}, unknown {sorted(unknown)}")
    job_id = fields.pop("id")
    index = base.__dict__.get("array_index")
    fields.setdefault("array_index", 0)
    own = {}
    for name, value in fields.items():
        held = index.at(job_id) if name == "array_index" and index is not None else getattr(base, name, _NONE)
        if held is not value and (type(held) is not type(value) or held != value):
            own[name] = value
    job = object.__new__(base._changed if own else base)
    object.__setattr__(job, "id", job_id)
    for name, value in own.items():
        object.__setattr__(job, name, value)
    return job


def _made(self: Job, **fields: object) -> None:
    """(An element is made whole by _element.)"""


_NONE = object()


DEPENDENCIES = (
    "after",
    "after_arrays",
    "after_any",
    "after_any_arrays",
    "after_notok",
    "after_notok_arrays",
)


def depends(job: Job) -> bool:
    """Whether it waits for other jobs (--after)."""
    return bool(
        job.after
        or job.after_arrays
        or job.after_any
        or job.after_any_arrays
        or job.after_notok
        or job.after_notok_arrays
    )


def element(cls: Type[Job], job_id: int) -> Job:
    """An array's element as submitted: an object of its array's class (array_class, with the array's
    indices) that holds only its id (Job's __init__ over every field: 40 µs an element, 0.4 s of 10 000)."""
    job = object.__new__(cls)
    object.__setattr__(job, "id", job_id)
    return job


def started(job: Job, gpus: Tuple[str, ...], now: float, leader_pid: int, leader_ticks: int) -> Job:
    """It runs now, on these GPUs, under this leader."""
    return dataclasses.replace(
        job,
        state=RUNNING,
        gpus=gpus,
        started=now,
        ended=None,
        exit_status=None,  # (the last run's, until this one ends)
        signal=0,
        reason="",
        leader_pid=leader_pid,
        leader_ticks=leader_ticks,
    )


def stopping(job: Job, why: str, by: str = "") -> Job:
    """A stop is under way (why: one of STOP_*; by: who cancelled it)."""
    return dataclasses.replace(job, state=STOPPING, reason=why, stopped_by=by)


def preempted(job: Job, now: float, why: str) -> Job:
    """Someone else took one of its GPUs (why: `GPU 1 busy: bob python3[4242]`): it is stopping."""
    return dataclasses.replace(stopping(job, STOP_PREEMPT), preempted_at=now, preempted_reason=why)


def waited_since(job: Job) -> float:
    """Since when it waits (or waited before its current run): its submission, or its last requeue."""
    return job.queued_at if job.queued_at is not None else job.submitted


def _ran(job: Job, now: float) -> float:
    return max(0.0, now - (job.started or now)) * max(1, len(job.gpus))


def ended(job: Job, now: float, returncode: int, signal: int = 0) -> Job:
    """Its run ended: done, failed, or what its stop was for (back in the queue after a preemption).
    signal: the one that ended it (0: it exited with returncode)."""
    used = job.gpu_seconds + _ran(job, now)
    ran = job.ran_seconds + max(0.0, now - (job.started or now))
    base = dataclasses.replace(
        job,
        gpu_seconds=used,
        ran_seconds=ran,
        leader_pid=0,
        leader_ticks=0,
        exit_status=returncode,
        signal=signal,
    )
    if job.state == STOPPING and job.reason == STOP_PREEMPT:
        if job.requeue:
            return dataclasses.replace(
                base, state=QUEUED, restarts=job.restarts + 1, reason="preempted", queued_at=now
            )
        return dataclasses.replace(base, state=PREEMPTED, ended=now, reason="preempted (no requeue)")
    if job.state == STOPPING and job.reason == STOP_RESTART:
        return dataclasses.replace(
            base,
            state=QUEUED,
            restarts=job.restarts + 1,
            exit_status=None,
            signal=0,
            reason="gpu-mon restarted",
            queued_at=now,
        )
    if job.state == STOPPING and job.reason == STOP_TIMEOUT:
        return dataclasses.replace(
            base, state=TIMEOUT, ended=now, exit_status=124, signal=0, reason="time limit"
        )
    if job.state == STOPPING and job.reason == STOP_CANCEL:
        by = f" by {job.stopped_by}" if job.stopped_by else ""  # (as a queued job's: `cancelled by alice`)
        return dataclasses.replace(base, state=CANCELLED, ended=now, reason=f"cancelled{by} while running")
    state = DONE if returncode == 0 else FAILED
    return dataclasses.replace(base, state=state, ended=now, reason="")


def run_lost(job: Job, now: float) -> Job:
    """Its run is gone with an earlier daemon (no exit status seen): a stop under way ends as it was meant
    to (a cancel cancelled, a time limit timeout); a running job goes back to the queue, as a restart."""
    if job.state == STOPPING and job.reason != STOP_RESTART:
        return ended(job, now, 128 + 9, 9)
    return dataclasses.replace(requeued_after_restart(job), restarts=job.restarts + 1, queued_at=now)


def requeued_after_restart(job: Job) -> Job:
    """The daemon that ran it is gone (and its processes with it): back in the queue, in its place."""
    return dataclasses.replace(
        job, state=QUEUED, leader_pid=0, leader_ticks=0, reason="daemon restarted", exit_status=None, signal=0
    )


def cancelled(job: Job, now: float, reason: str) -> Job:
    """A queued or held job is cancelled (a running one is stopped first: see `stopping`)."""
    return dataclasses.replace(job, state=CANCELLED, ended=now, reason=reason)


def held(job: Job) -> Job:
    """A queued job is held: it does not start until released."""
    return dataclasses.replace(job, state=HELD)


def released(job: Job) -> Job:
    """A held job goes back to waiting, in its place."""
    return dataclasses.replace(job, state=QUEUED)
