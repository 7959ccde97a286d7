"""What the queue tells the daemon's outputs (status, history, metrics) after a round: how many jobs are in
each state, the jobs running now, and the runs that began or ended since the last report. Found by
comparing the store's jobs with what was seen before, so that every way a run starts or ends (a start, an
exit, a preemption, a cancel, an earlier daemon's run found at start) is counted the same way. No I/O.

A run ends as `done`, `failed`, `cancelled`, `timeout`, `preempted` (someone else took one of its GPUs:
it went back to the queue, or ended so with --no-requeue) or `requeued` (back in the queue because
gpu-mon stopped or restarted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

PREEMPTED, REQUEUED = "preempted", "requeued"
HOW = (J.DONE, J.FAILED, J.CANCELLED, J.TIMEOUT, PREEMPTED, REQUEUED)  # how a run ends
NAME_LIMIT = 40  # characters of the command shown for a job without a name


@dataclass(frozen=True)
class JobRun:
    """One run of a job: from its start on its GPUs to its end (None while it runs, or when an earlier
    daemon's run ended unseen: then the last time that daemon recorded counts)."""

    job: int
    user: str
    name: str  # its --name, else the start of its command
    gpus: Tuple[str, ...]
    submitted: float
    start: float
    wait: float  # seconds from its submission (or its last requeue) to this start
    restart: int  # GPU_MON_RESTART_COUNT of this run
    state: str = J.RUNNING  # running or stopping while it runs
    end: Optional[float] = None
    how: str = J.RUNNING  # one of HOW once it ended
    earlier: bool = False  # it began under an earlier daemon
    array_id: int = 0  # an array's element: its array and index (J.shown names it `17_5`)
    array_index: int = 0
    preempted_by: str = ""  # how = preempted: why, naming who (`GPU 1 busy: bob python3[4242] holds ...`)
    energy_mj: Optional[float] = None  # once it ended: over its GPUs (runrecords.py); None: not known


Hook = Callable[[JobRun], JobRun]


@dataclass(frozen=True)
class QueueReport:
    """The queue after a round."""

    counts: Dict[str, int]  # every state of jobs.STATES, 0 when none
    running: Tuple[JobRun, ...]  # the runs going on now (running or stopping), by job id
    started: Tuple[JobRun, ...] = ()  # since the last report
    ended: Tuple[JobRun, ...] = ()
    drained: Optional[Tuple[str, float]] = None  # `gpu-mon queue drain`: by whom, when (wall); None: not


def label(job: Job) -> str:
    """What a job is called in status: its name, or the start of its command."""
    if job.name:
        return job.name
    text = " ".join(job.command)
    return text if len(text) <= NAME_LIMIT else text[: NAME_LIMIT - 3] + "..."


def _run(job: Job, earlier: bool) -> JobRun:
    start = job.started if job.started is not None else 0.0
    return JobRun(
        job=job.id,
        user=job.user,
        name=label(job),
        gpus=tuple(job.gpus),
        submitted=job.submitted,
        start=start,
        wait=max(0.0, start - J.waited_since(job)),
        restart=job.restarts,
        state=job.state,
        earlier=earlier,
        array_id=job.array_id,
        array_index=job.array_index,
    )


def how_it_ended(job: Optional[Job]) -> str:
    """How the last run of a job that no longer runs ended, from the job as it is now."""
    if job is None:
        return REQUEUED  # (gone from the store: nothing better is known)
    if job.state in (J.DONE, J.FAILED, J.CANCELLED, J.TIMEOUT):
        return job.state
    if job.state == J.PREEMPTED or job.reason == "preempted":
        return PREEMPTED
    return REQUEUED


class Runs:
    """Remembers the runs seen going on; `seen` compares, `take` hands out what changed."""

    def __init__(self) -> None:
        self.live: Dict[int, JobRun] = {}
        self.counts: Dict[str, int] = dict.fromkeys(J.STATES, 0)
        self.started: List[JobRun] = []
        self.ended: List[JobRun] = []
        self.version: Optional[int] = None
        self.first = True

    def seen(self, jobs: Iterable[Job], version: int, wall: float, hook: Optional[Hook] = None) -> None:
        """Compare the store's jobs (at this version) with the runs seen before. The first call's runs
        are an earlier daemon's: they went with it (their processes were stopped when it died), at a time
        not known here, so their end is None. `hook` hears each run that starts or ends, once (the
        queue's records: runrecords.py), and may return it with more said (its energy)."""
        hook = hook or (lambda run: run)
        if version == self.version:
            return
        self.version = version
        counts = dict.fromkeys(J.STATES, 0)
        now: Dict[int, Job] = {}
        by_id: Dict[int, Job] = {}
        for job in jobs:
            counts[job.state] = counts.get(job.state, 0) + 1
            if job.state in J.LIVE and job.started is not None:
                now[job.id] = job
            elif job.id in self.live:
                by_id[job.id] = job
        self.counts = counts
        for job_id, run in list(self.live.items()):
            job = now.get(job_id)
            if job is not None and job.started == run.start:
                self.live[job_id] = dataclasses.replace(run, state=job.state)
                continue
            del self.live[job_id]
            ended = hook(self._end(run, by_id.get(job_id), job, wall))
            self.ended.append(dataclasses.replace(ended, end=None) if run.earlier else ended)
        for job_id, job in now.items():
            if job_id not in self.live:
                run = _run(job, self.first)
                self.live[job_id] = run
                self.started.append(hook(run))
        self.first = False

    def _end(self, run: JobRun, job: Optional[Job], again: Optional[Job], wall: float) -> JobRun:
        if again is not None:  # it ended and started again between two looks: its restart says why
            return dataclasses.replace(run, end=again.queued_at or again.started, how=REQUEUED)
        end = job.ended if job is not None and job.ended is not None and job.ended >= run.start else wall
        how = how_it_ended(job)
        by = job.preempted_reason if how == PREEMPTED and job is not None else ""
        return dataclasses.replace(run, end=end, how=how, preempted_by=by)

    def take(self) -> QueueReport:
        """The queue now, with the runs that began or ended since the last `take`."""
        out = QueueReport(
            counts=dict(self.counts),
            running=tuple(sorted(self.live.values(), key=lambda r: r.job)),
            started=tuple(self.started),
            ended=tuple(self.ended),
        )
        self.started, self.ended = [], []
        return out
