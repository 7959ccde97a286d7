"""Pure placement: which queued job starts where, which running job must yield, what waits and why.

`place` takes the queue's jobs, each queue GPU's state from the daemon's policy (busy with reasons, free
since when, which [process-*] workload runs on it), the [queue] limits and the time, and returns typed
decisions and a typed reason for every waiting job; words come only in the front-ends. No I/O, no clock.

Tiers: someone else's use of a GPU stops a job on it (the policy's verdict says busy), except that a process
that only holds the GPU's node must have held it for [queue] brief_open_seconds first (a brief probe that
let go by then stops nothing; anything else that makes the GPU busy stops the job at once); a job outranks a
[process-*] workload (it takes the workload's GPU when `preempt_workloads`). Order: `fair` (fewest
GPU-seconds over the window first, then priority, then submission) or `fifo` (priority, then submission);
a job that cannot start does not keep a later one from starting on other GPUs, but the head of the order (the
first job that waits for GPUs, not for a limit or a job of its own) is not starved: it gets a reservation
(reservation.py), the GPUs it will have first, and a free one of them is kept for it; a later job may use a
kept GPU only when its time limit ends before the reservation's start (Slurm's backfill). One reservation,
the head's; the jobs behind it get an estimated start (the first reservation.ESTIMATED of them). Cost:
O(jobs * GPUs) plus a sort, never quadratic in the number of jobs.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from gpu_mon.config import QueueSection
from gpu_mon.policy.decisions import Reason
from gpu_mon.queue import jobs as J
from gpu_mon.queue.afterspec import AFTERANY, AFTERNOTOK, AFTEROK
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.reservation import ESTIMATED, NOT_OURS, OURS, UNKNOWN, Reservation, Timeline, fits_before

FAILED_DEPENDENCY = (J.FAILED, J.CANCELLED, J.PREEMPTED, J.TIMEOUT)


@dataclass(frozen=True)
class GpuView:
    """One queue GPU as the policy saw it in this round."""

    uuid: str
    busy: bool
    reason: Optional[Reason] = None  # the first reason it is busy
    free_since: Optional[float] = None
    workload: str = ""  # the key of a [process-*] workload running on it
    workload_stopping: bool = False
    held_since: Optional[float] = None  # busy only by holders of its node: since when (Verdict.held_since)


@dataclass(frozen=True)
class StartJob:
    job: int
    gpus: Tuple[str, ...]


@dataclass(frozen=True)
class SoonJob:
    """A start that waits only for the start delay: `start` at `at` (monotonic) if nothing changes."""

    start: StartJob
    at: float


@dataclass(frozen=True)
class PreemptJob:
    """Someone else uses one of the job's GPUs: stop it (urgently), back to the queue."""

    job: int
    gpu: str
    reason: Optional[Reason]


@dataclass(frozen=True)
class ConfirmJob:
    """Someone else opened one of the job's GPUs and holds its node: the job stops only if the GPU is still
    held at `at` (monotonic; the holders looked at again then), else it runs on."""

    job: int
    gpu: str
    reason: Optional[Reason]
    at: float


@dataclass(frozen=True)
class TimeUp:
    job: int


@dataclass(frozen=True)
class CancelJob:
    """One of its --after dependencies can never be met: an afterok job ended without success, an
    afternotok job (or every element of an afternotok array) is done, or a job named does not exist."""

    job: int
    after: int
    after_state: str  # "" when that job does not exist
    kind: str = AFTEROK  # afterok, afterany or afternotok
    array: int = 0  # the array the dependency names whole (then `after` is its element that decided)


@dataclass(frozen=True)
class PreemptWorkload:
    """A queued job takes this workload's GPU (the workload gets its full grace)."""

    workload: str
    job: int
    gpu: str


@dataclass(frozen=True)
class Waiting:
    """Why a queued job does not start now. kind: busy (gpu, reason), taken (gpu, by_job or by_workload),
    after (after), running_limit (count running, starting: of them placed but not yet started; limit),
    gpu_limit (count, limit), array_limit (count: the array's elements running, limit: its %N), ahead
    (count), start_delay (until: wall-clock, as the jobs' times are),
    too_many_gpus (count: the queue's GPUs), over_job_limit / over_user_limit (count: GPUs wanted, limit:
    GPUs per job or per user; it can never start under these limits), drained (the admin drained the
    queue: no job starts), kept (gpu: free, but kept for by_job, the head of the order, and this job's
    time limit does not end before that one's reserved start)."""

    kind: str
    gpu: str = ""
    reason: Optional[Reason] = None
    by_job: str = ""  # (as users name jobs: 17, 17_5)
    by_workload: str = ""
    after: str = ""
    count: int = 0
    limit: int = 0
    until: Optional[float] = None
    starting: int = 0
    after_kind: str = ""  # (kind after) afterany or afternotok; "" for afterok


@dataclass(frozen=True)
class Placement:
    starts: Tuple[StartJob, ...] = ()
    preempt_jobs: Tuple[PreemptJob, ...] = ()
    confirms: Tuple[ConfirmJob, ...] = ()  # (next_wake counts them)
    time_up: Tuple[TimeUp, ...] = ()
    cancels: Tuple[CancelJob, ...] = ()
    preempt_workloads: Tuple[PreemptWorkload, ...] = ()
    waiting: Dict[int, Waiting] = field(default_factory=dict)
    claimed: Dict[str, int] = field(default_factory=dict)  # GPU -> job that runs on it or will soon
    next_wake: Optional[float] = None
    soon: Tuple[SoonJob, ...] = ()  # (next_wake counts them)
    other_wakes: Tuple[float, ...] = ()  # the wakes that are not the soon starts' (time limits)
    reservation: Optional[Reservation] = None  # the head of the order's
    kept: Dict[str, int] = field(default_factory=dict)  # free GPU -> the job it is kept for (reservation)
    estimates: Dict[int, float] = field(default_factory=dict)  # queued job -> its estimated start (wall)


@dataclass
class _Users:
    """Per user: GPUs and jobs running (this round's starts included), GPU-seconds over the window."""

    running: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    in_array: Dict[int, int] = field(default_factory=lambda: defaultdict(int))  # array id -> elements live
    starting: Dict[str, int] = field(default_factory=lambda: defaultdict(int))  # of running: not yet started
    gpus: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    usage: Dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _users(live: Sequence[Job], used: Sequence[Job], now: float, window: float) -> _Users:
    """From the running jobs, and the others with GPU-seconds of runs that ended."""
    u = _Users()
    for j in live:
        u.running[j.user] += 1
        if j.array_id:
            u.in_array[j.array_id] += 1
        u.gpus[j.user] += len(j.gpus)
        u.usage[j.user] += j.gpu_seconds + max(0.0, now - (j.started or now)) * len(j.gpus)
    for j in used:
        if j.ended is None or j.ended >= now - window:
            u.usage[j.user] += j.gpu_seconds
    return u


def confirm_at(gpu: GpuView, brief: float) -> Optional[float]:
    """When the use of a busy GPU stops the jobs on it, if not at once: a GPU that only processes holding
    its node make busy must have been held for `brief` seconds (monotonic time; they are looked at again
    then). None: now (busy for any other reason, which counts at once, or `brief` is 0)."""
    if not gpu.busy or gpu.held_since is None or brief <= 0:
        return None
    return gpu.held_since + brief


def _running(
    jobs: Sequence[Job], gpus: Dict[str, GpuView], now: float, wall: float, out: dict, brief: float
) -> None:
    """Stops for running jobs: someone else on one of their GPUs (a holder of its node only once it has
    held it `brief` seconds: until then a confirm), or their time is up (job times are wall-clock, wakes
    monotonic)."""
    for j in jobs:
        if j.state != J.RUNNING:
            continue
        later: Dict[str, float] = {}  # its GPUs held for less than `brief`: when to look again
        busy = []
        for u in j.gpus:
            g = gpus.get(u)
            if g is None or not g.busy:
                continue
            at = confirm_at(g, brief)
            if at is not None and at > now:
                later[u] = at
            else:
                busy.append(u)
        if busy:
            out["preempt"].append(PreemptJob(j.id, busy[0], gpus[busy[0]].reason))
            continue
        if later:
            u = min(later, key=later.__getitem__)
            out["confirm"].append(ConfirmJob(j.id, u, gpus[u].reason, later[u]))
            out["wakes"].append(later[u])
        if j.time_limit is not None and j.started is not None:
            end = j.started + j.time_limit
            if wall >= end:
                out["time_up"].append(TimeUp(j.id))
            else:
                out["wakes"].append(now + (end - wall))


@dataclass(frozen=True)
class _ArrayEnd:
    """How far an array is, for the jobs that wait for all of it: an element that ended without success
    (its id and state), one not done yet, one not ended yet."""

    failed: Optional[Job] = None
    not_done: Optional[Job] = None
    not_ended: Optional[Job] = None


_NOTHING_YET = _ArrayEnd()


def _arrays(jobs: Iterable[Job], wanted: set) -> Dict[int, _ArrayEnd]:
    """The arrays that some job waits for, each judged once (not once per waiting element)."""
    out: Dict[int, _ArrayEnd] = {}
    for j in jobs:
        if j.array_id not in wanted:
            continue
        now = out.get(j.array_id, _NOTHING_YET)
        state = j.state
        failed = now.failed if now.failed is not None or state not in FAILED_DEPENDENCY else j
        not_done = now.not_done if now.not_done is not None or state == J.DONE else j
        not_ended = now.not_ended if now.not_ended is not None or state in J.ENDED else j
        changed = failed is not now.failed or not_done is not now.not_done or not_ended is not now.not_ended
        if now is _NOTHING_YET or changed:  # (identity: a Job's == compares every field)
            out[j.array_id] = _ArrayEnd(failed, not_done, not_ended)
    return out


def _job_kinds(job: Job) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """The jobs it waits for, by kind."""
    return (AFTEROK, job.after), (AFTERANY, job.after_any), (AFTERNOTOK, job.after_notok)


def _array_kinds(job: Job) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """The whole arrays it waits for, by kind."""
    return (AFTEROK, job.after_arrays), (AFTERANY, job.after_any_arrays), (AFTERNOTOK, job.after_notok_arrays)


def _unmet(job: Job, by_id: Mapping[int, Job], arrays: Dict[int, _ArrayEnd]) -> Optional[CancelJob]:
    """The first of its dependencies that can never be met, or None."""
    for kind, ids in _job_kinds(job):
        for dep_id in ids:
            dep = by_id.get(dep_id)
            never = (J.DONE,) if kind == AFTERNOTOK else () if kind == AFTERANY else FAILED_DEPENDENCY
            if dep is None or dep.state in never:
                return CancelJob(job.id, dep_id, dep.state if dep else "", kind)
    for kind, ids in _array_kinds(job):
        for array_id in ids:
            end = arrays.get(array_id)
            if end is None:
                return CancelJob(job.id, array_id, "", kind, array_id)
            if kind == AFTEROK and end.failed is not None:
                return CancelJob(job.id, end.failed.id, end.failed.state, kind, array_id)
            if kind == AFTERNOTOK and end.not_done is None:  # (every element done)
                return CancelJob(job.id, array_id, J.DONE, kind, array_id)
    return None


def _dependency(
    job: Job, by_id: Dict[int, Job], arrays: Dict[int, _ArrayEnd]
) -> Tuple[Optional[CancelJob], Optional[Waiting]]:
    cancel = _unmet(job, by_id, arrays)
    if cancel is not None:
        return cancel, None
    for kind, ids in _job_kinds(job):
        for dep_id in ids:
            dep = by_id[dep_id]
            if (dep.state != J.DONE) if kind == AFTEROK else (dep.state not in J.ENDED):
                return None, Waiting("after", after=J.ref(dep), after_kind="" if kind == AFTEROK else kind)
    for kind, ids in _array_kinds(job):
        for array_id in ids:
            end = arrays[array_id]
            if (end.not_done if kind == AFTEROK else end.not_ended) is not None:
                return None, Waiting("after", after=str(array_id), after_kind="" if kind == AFTEROK else kind)
    return None, None


def never_met(job: Job, by_id: Mapping[int, Job], elements: Iterable[Job]) -> Optional[CancelJob]:
    """Whether a job's dependencies can never be met, as the jobs are now (a submit's, an update's check):
    `by_id` every job, `elements` those of the arrays it names."""
    wanted = {*job.after_arrays, *job.after_any_arrays, *job.after_notok_arrays}
    return _unmet(job, by_id, _arrays(elements, wanted) if wanted else {})


_BY_ID, _BY_PRIORITY = operator.attrgetter("id"), operator.attrgetter("priority")


def _order(cands: List[Job], users: _Users, fair: bool) -> List[Job]:
    """Candidates in the order they may take GPUs."""
    cands.sort(key=_BY_ID)  # (then by priority, highest first: a stable sort keeps ids in order within one)
    cands.sort(key=_BY_PRIORITY, reverse=True)
    if not fair:
        return cands
    per_user: Dict[str, List[Job]] = defaultdict(list)
    for j in cands:
        per_user[j.user].append(j)
    heap = [(users.usage[u], users.gpus[u], -js[0].priority, js[0].id, u, 0) for u, js in per_user.items()]
    heapq.heapify(heap)
    out: List[Job] = []
    taken: Dict[str, int] = defaultdict(int)
    while heap:
        _usage, _gpus, _p, _id, user, at = heapq.heappop(heap)
        job = per_user[user][at]
        out.append(job)
        taken[user] += job.gpus_wanted  # a user's next job ranks behind others' first ones
        if at + 1 < len(per_user[user]):
            nxt = per_user[user][at + 1]
            heapq.heappush(
                heap, (users.usage[user], users.gpus[user] + taken[user], -nxt.priority, nxt.id, user, at + 1)
            )
    return out


class _Placer:
    def __init__(
        self, gpus: Sequence[GpuView], q: QueueSection, delay: float, now: float, wall: float, users: _Users
    ):
        self.gpus, self.q, self.delay, self.users = list(gpus), q, delay, users
        self.now, self.wall = now, wall  # monotonic (the GPUs' free_since), wall-clock (the jobs' times)
        self.claimed: Dict[str, int] = {}
        self.by_id: Dict[int, Job] = {}  # (to name a claimant)
        self.starts: List[StartJob] = []
        self.preempt_workloads: List[PreemptWorkload] = []
        self.soon: List[SoonJob] = []
        self.waiting_before = 0
        self.open: Optional[List[GpuView]] = None  # GPUs still open to jobs in this round
        self.started_at: Dict[int, float] = {}  # this round's starts: when (wall-clock)
        self.timeline: Optional[Timeline] = None  # (made for the head of the order)
        self.reservation: Optional[Reservation] = None
        self.kept: Dict[str, int] = {}
        self.estimates: Dict[int, float] = {}
        self.estimated = 0

    def place(self, job: Job) -> Optional[Waiting]:
        """Start it, or claim GPUs for it (a workload to stop, a start delay), or say why it waits."""
        wait = self._limits(job)
        if wait is None:
            wait = self._gpus_for(job)
        if wait is not None and wait.kind in ("busy", "taken", "ahead", "kept"):
            self.waiting_before += 1  # it waits for GPUs: the jobs after it are behind it
            self._plan_ahead(job)
        return wait

    def _plan_ahead(self, job: Job) -> None:
        """A job waits for GPUs: the first one gets the reservation; each (up to ESTIMATED) an estimated
        start, its GPUs booked on the timeline from then for the jobs behind it."""
        if self.timeline is None:
            self.timeline = Timeline(self._ready_times())
            chosen = self.timeline.earliest(job.gpus_wanted)
            if self.timeline.promised(chosen):  # (a foreign user's GPU is not ours to promise: none)
                self.reservation = Reservation(job.id, tuple(chosen), self.timeline.start_on(chosen))
                free = {g.uuid for g in self.open or ()} - self.claimed.keys()
                self.kept = {u: job.id for u in chosen if u in free}
        elif self.estimated >= ESTIMATED or self.timeline.all_unknown():
            return
        self.estimated += 1
        chosen = self.timeline.earliest(job.gpus_wanted)
        start = self.timeline.start_on(chosen)
        if start is not None:
            self.estimates[job.id] = start
        self.timeline.book(chosen, start, job.time_limit, self.delay)

    def _ready_times(self) -> Dict[str, Tuple[float, int]]:
        """When each queue GPU is next ready for a job (wall-clock, its start delay over), and whether it is
        ours to promise: free, or a job's of ours (its time limit's end; UNKNOWN without one)."""
        out: Dict[str, Tuple[float, int]] = {}
        for g in self.gpus:
            owner = self.claimed.get(g.uuid)
            if g.busy or (owner is None and g.workload and not self.q.preempt_workloads):
                out[g.uuid] = (UNKNOWN, NOT_OURS)
            elif owner is not None:
                out[g.uuid] = (self._ready_after(self.by_id[owner]), OURS)
            else:
                since = g.free_since if g.free_since is not None else self.now
                out[g.uuid] = (self.wall + max(0.0, since + self.delay - self.now), OURS)
        return out

    def _ready_after(self, job: Job) -> float:
        """When a job's GPUs are ready for the next one: its time limit's end, then the start delay."""
        start = self.started_at.get(job.id, job.started)
        if job.state == J.STOPPING:
            return self.wall + self.delay  # (it ends within its grace)
        if job.time_limit is None or start is None:
            return UNKNOWN
        return max(self.wall, start + job.time_limit) + self.delay

    def _limits(self, job: Job) -> Optional[Waiting]:
        never = never_fits(job.gpus_wanted, len(self.gpus), self.q)
        if never is not None:
            return never
        q, u = self.q, self.users
        if q.max_running_per_user and u.running[job.user] >= q.max_running_per_user:
            running, limit = u.running[job.user], q.max_running_per_user
            return Waiting("running_limit", count=running, limit=limit, starting=u.starting[job.user])
        if q.max_gpus_per_user and u.gpus[job.user] + job.gpus_wanted > q.max_gpus_per_user:
            return Waiting("gpu_limit", count=u.gpus[job.user], limit=q.max_gpus_per_user)
        if job.array_limit and u.in_array[job.array_id] >= job.array_limit:
            return Waiting("array_limit", count=u.in_array[job.array_id], limit=job.array_limit)
        return None

    def _gpus_for(self, job: Job) -> Optional[Waiting]:
        if self.open is None:  # (made once the live jobs' claims are in)
            usable = [g for g in self.gpus if not g.busy and g.uuid not in self.claimed]
            if not self.q.preempt_workloads:
                usable = [g for g in usable if not g.workload]
            self.open = sorted(usable, key=lambda g: bool(g.workload))  # GPUs nobody of ours uses first
        usable = [g for g in self.open if g.uuid not in self.claimed]
        self.open = usable
        if self.kept and len(usable) >= job.gpus_wanted:
            usable = self._not_kept(job, usable)
            if isinstance(usable, Waiting):
                return usable
        if len(usable) < job.gpus_wanted:
            return self._why_not(job)
        chosen = usable[: job.gpus_wanted]
        for g in chosen:
            self.claimed[g.uuid] = job.id
        self.users.running[job.user] += 1
        self.users.gpus[job.user] += job.gpus_wanted
        if job.array_id:
            self.users.in_array[job.array_id] += 1
        with_workload = [g for g in chosen if g.workload]
        if with_workload:
            for g in with_workload:
                if not g.workload_stopping:
                    self.preempt_workloads.append(PreemptWorkload(g.workload, job.id, g.uuid))
            self.users.starting[job.user] += 1
            self._booked(job, chosen, self.wall)  # (once the workload has stopped: soon)
            return Waiting("taken_for", gpu=with_workload[0].uuid, by_workload=with_workload[0].workload)
        ready_at = self._ready_at(chosen)
        start = StartJob(job.id, tuple(g.uuid for g in chosen))
        self._booked(job, chosen, self.wall + max(0.0, ready_at - self.now))
        if ready_at > self.now:
            self.soon.append(SoonJob(start, ready_at))  # (monotonic, as free_since; the reason: wall-clock)
            self.users.starting[job.user] += 1
            self.estimates[job.id] = self.wall + (ready_at - self.now)
            return Waiting("start_delay", until=self.wall + (ready_at - self.now))
        self.starts.append(start)
        return None

    def _ready_at(self, chosen: List[GpuView]) -> float:
        """When a job may start on these free GPUs (monotonic): each free for the start delay."""
        return max((g.free_since if g.free_since is not None else self.now) for g in chosen) + self.delay

    def _booked(self, job: Job, chosen: List[GpuView], start: float) -> None:
        """It starts at `start` (wall-clock): when its GPUs are next ready, for the timeline."""
        self.started_at[job.id] = start
        if self.timeline is not None:
            self.timeline.book([g.uuid for g in chosen], start, job.time_limit, self.delay)

    def _not_kept(self, job: Job, usable: List[GpuView]) -> Union[List[GpuView], Waiting]:
        """The open GPUs this job may take: those not kept for the reservation, and the kept ones too when
        it ends before the reservation's start (a backfill); else why it waits (`kept`)."""
        plain = [g for g in usable if g.uuid not in self.kept]
        if len(plain) >= job.gpus_wanted:
            return plain
        kept = [g for g in usable if g.uuid in self.kept]
        chosen = (plain + kept)[: job.gpus_wanted]
        start = self.wall + max(0.0, self._ready_at(chosen) - self.now)
        assert self.reservation is not None
        if fits_before(start, job.time_limit, self.delay, self.reservation):
            return plain + kept
        head = J.ref(self.by_id[self.reservation.job])
        return Waiting("kept", gpu=kept[0].uuid, by_job=head)

    def _why_not(self, job: Job) -> Waiting:
        if self.waiting_before:
            return Waiting("ahead", count=self.waiting_before)
        for g in self.gpus:
            if g.busy:
                return Waiting("busy", gpu=g.uuid, reason=g.reason)
        for g in self.gpus:
            if g.uuid in self.claimed:
                return Waiting("taken", gpu=g.uuid, by_job=J.ref(self.by_id[self.claimed[g.uuid]]))
            if g.workload:
                return Waiting("taken", gpu=g.uuid, by_workload=g.workload)
        return Waiting("ahead", count=0)


def never_fits(gpus_wanted: int, queue_gpus: int, q: QueueSection) -> Optional[Waiting]:
    """Why a job that wants this many GPUs can never start under the queue's GPUs and limits, or None."""
    if q.max_gpus_per_job and gpus_wanted > q.max_gpus_per_job:
        return Waiting("over_job_limit", count=gpus_wanted, limit=q.max_gpus_per_job)
    if q.max_gpus_per_user and gpus_wanted > q.max_gpus_per_user:
        return Waiting("over_user_limit", count=gpus_wanted, limit=q.max_gpus_per_user)
    if gpus_wanted > queue_gpus:
        return Waiting("too_many_gpus", count=queue_gpus)
    return None


def stops(
    jobs: Sequence[Job], gpus: Sequence[GpuView], now: float, wall: float, brief: float = 0.0
) -> Placement:
    """Only what must stop now (someone else on a running job's GPU, a time limit) and the holders to
    confirm (`brief`: [queue] brief_open_seconds): the yield path's part of `place`, in time proportional
    to the running jobs."""
    out: dict = {"preempt": [], "confirm": [], "time_up": [], "wakes": []}
    _running(jobs, {g.uuid: g for g in gpus}, now, wall, out, brief)
    return Placement(
        preempt_jobs=tuple(out["preempt"]),
        confirms=tuple(out["confirm"]),
        time_up=tuple(out["time_up"]),
        next_wake=min(out["wakes"]) if out["wakes"] else None,
    )


def place(
    jobs: Sequence[Job],
    gpus: Sequence[GpuView],
    q: QueueSection,
    start_delay: float,
    now: float,
    wall: float,
    drained: bool = False,
) -> Placement:
    """Decide the queue's round. `now` is the monotonic time of the GPUs' views (free_since), `wall` the
    wall-clock time of the jobs' times; `drained`: no job starts (nor claims a GPU), running ones go on.
    Pure: inputs are not changed."""
    by_id = {j.id: j for j in jobs}
    sorted_out = _sort(jobs)
    out: dict = {"preempt": [], "confirm": [], "time_up": [], "wakes": []}
    _running(sorted_out.live, {g.uuid: g for g in gpus}, now, wall, out, q.brief_open_seconds)
    users = _users(sorted_out.live, sorted_out.used, wall, q.fair_window_hours * 3600)
    placer = _Placer(gpus, q, start_delay, now, wall, users)
    placer.by_id = by_id
    for j in sorted_out.live:
        for u in j.gpus:
            placer.claimed[u] = j.id
    cands, cancels, waiting = _dependencies(sorted_out, jobs, by_id)
    if drained:
        waiting.update((j.id, Waiting("drained")) for j in cands)
        cands = []
    for j in _order(cands, users, q.order == "fair"):
        wait = placer.place(j)
        if wait is not None:
            waiting[j.id] = wait
    wakes = out["wakes"] + [s.at for s in placer.soon]
    return Placement(
        starts=tuple(placer.starts),
        preempt_jobs=tuple(out["preempt"]),
        confirms=tuple(out["confirm"]),
        time_up=tuple(out["time_up"]),
        cancels=tuple(cancels),
        preempt_workloads=tuple(placer.preempt_workloads),
        waiting=waiting,
        claimed=dict(placer.claimed),
        next_wake=min(wakes) if wakes else None,
        soon=tuple(placer.soon),
        other_wakes=tuple(out["wakes"]),
        reservation=placer.reservation,
        kept=placer.kept,
        estimates=placer.estimates,
    )


def later(plan: Placement, now: float) -> Placement:
    """The same placement at a later time, when nothing it was made from (the jobs, the GPUs) has changed:
    the soon starts whose start delay is over start, in the order the placement chose them (each was told
    it starts then; a re-placement could hand its GPU to another user's job whose fair share grew in the
    meantime); nothing else it decided depends on the time. The cost of a start at the delay's end is then
    that of the jobs starting, not of every job queued."""
    due = [s for s in plan.soon if s.at <= now]
    soon = tuple(s for s in plan.soon if s.at > now)
    waiting = dict(plan.waiting) if due else plan.waiting  # (a hook's look: nothing to copy)
    for s in due:
        waiting.pop(s.start.job, None)
    wakes = [*(w for w in plan.other_wakes if w > now), *(s.at for s in soon)]
    return dataclasses.replace(
        plan,
        starts=tuple(s.start for s in due),
        preempt_jobs=(),
        confirms=(),
        time_up=(),
        cancels=(),
        preempt_workloads=(),
        waiting=waiting,
        next_wake=min(wakes) if wakes else None,
        soon=soon,
    )


@dataclass
class _Sorted:
    """The jobs by what placement does with them, each list in submission order."""

    live: List[Job] = field(default_factory=list)  # running or stopping
    used: List[Job] = field(default_factory=list)  # not live, with GPU-seconds of runs that ended
    free: List[Job] = field(default_factory=list)  # queued, waiting for no other job
    dependent: List[Job] = field(default_factory=list)  # queued or held, --after other jobs
    wanted: set = field(default_factory=set)  # the arrays that dependent jobs wait for


def _sort(jobs: Sequence[Job]) -> _Sorted:
    """One pass over every job."""
    out = _Sorted()
    waits = (J.QUEUED, J.HELD)
    for j in jobs:
        state = j.state
        if state in waits:
            if J.depends(j):
                out.dependent.append(j)
                out.wanted.update((*j.after_arrays, *j.after_any_arrays, *j.after_notok_arrays))
            elif state == J.QUEUED:
                out.free.append(j)
        elif state in J.LIVE:
            out.live.append(j)
            continue
        if j.gpu_seconds:
            out.used.append(j)
    return out


def _dependencies(
    s: _Sorted, jobs: Sequence[Job], by_id: Dict[int, Job]
) -> Tuple[List[Job], List[CancelJob], Dict[int, Waiting]]:
    """The queued jobs that may start (the free ones, and those whose --after jobs are done), the jobs to
    cancel (one they wait for failed), and why the others wait. Jobs waiting on the same jobs share one
    verdict (a sweep of 10 000 behind one job is judged once)."""
    arrays = _arrays(jobs, s.wanted) if s.wanted else {}
    cands = list(s.free)
    cancels: List[CancelJob] = []
    waiting: Dict[int, Waiting] = {}
    verdicts: Dict[tuple, Tuple[Optional[CancelJob], Optional[Waiting]]] = {}
    for j in s.dependent:
        key = tuple(getattr(j, name) for name in J.DEPENDENCIES)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = _dependency(j, by_id, arrays)
        cancel, wait = verdict
        if cancel is not None:
            cancels.append(dataclasses.replace(cancel, job=j.id) if cancel.job != j.id else cancel)
        elif wait is not None and j.state == J.QUEUED:
            waiting[j.id] = wait
        elif j.state == J.QUEUED:
            cands.append(j)
    return cands, cancels, waiting


def users_in_order(jobs: Sequence[Job], q: QueueSection, wall: float) -> Tuple[List[str], Dict[str, float]]:
    """`gpu-mon share`'s view of the order `place` follows: the users with queued jobs, in the order their
    next job would take GPUs ([queue] order: fair or fifo), and every user's GPU-seconds over the fair
    window (running jobs' included)."""
    s = _sort(jobs)
    users = _users(s.live, s.used, wall, q.fair_window_hours * 3600)
    queued = [j for j in jobs if j.state == J.QUEUED]
    order = list(dict.fromkeys(j.user for j in _order(queued, users, q.order == "fair")))
    return order, {u: seconds for u, seconds in users.usage.items() if seconds > 0}
