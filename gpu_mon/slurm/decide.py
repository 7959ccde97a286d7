"""Which preemptible Slurm jobs must yield, from one round's view of the GPUs. Pure: no I/O, no clock.

A preemptible job yields to anyone else's use of a GPU it holds: a process of no Slurm job (a user's
notebook or script), or of a job that is not preemptible. gpu-mon's own processes and ignored ones
(monitors, ignore_programs, ignore_users) never count: the caller leaves them out. Processes of other
preemptible jobs do not count either (the same tier: Slurm placed them side by side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Tuple

from gpu_mon.slurm.jobs import JobInfo


@dataclass(frozen=True)
class Use:
    """A process on GPUs (holding their nodes, or listed by NVML), with the job it belongs to."""

    pid: int
    user: str
    name: str
    gpus: FrozenSet[str]
    job: Optional[int] = None

    @property
    def label(self) -> str:
        """`alice python3[4242]`."""
        return f"{self.user} {self.name}[{self.pid}]"


@dataclass(frozen=True)
class Act:
    """A preemptible job that must yield: `by` uses `gpu`, which the job holds."""

    job: int
    gpu: str
    by: Use


def gpus_of_jobs(uses: Iterable[Use]) -> Dict[int, FrozenSet[str]]:
    """{job: the GPUs its processes hold}."""
    out: Dict[int, set] = {}
    for u in uses:
        if u.job is not None:
            out.setdefault(u.job, set()).update(u.gpus)
    return {j: frozenset(g) for j, g in out.items()}


def decide(
    uses: Tuple[Use, ...],
    jobs: Mapping[int, JobInfo],
    preemptible: Callable[[JobInfo], bool],
    done: FrozenSet[int] = frozenset(),
) -> Tuple[Act, ...]:
    """The jobs that must yield now, once each (`done`: jobs already acted on), in job order."""
    yielding = {j for j, info in jobs.items() if preemptible(info)}
    acts: List[Act] = []
    for job, gpus in sorted(gpus_of_jobs(uses).items()):
        if job not in yielding or job in done:
            continue
        for gpu in sorted(gpus):
            others = sorted(
                (u for u in uses if gpu in u.gpus and u.job != job and _foreign(u, jobs, yielding)),
                key=lambda u: u.pid,
            )
            if others:
                acts.append(Act(job=job, gpu=gpu, by=others[0]))
                break
    return tuple(acts)


def _foreign(use: Use, jobs: Mapping[int, JobInfo], yielding: set) -> bool:
    """Someone else's use: no job's, or a job's that Slurm described and that is not preemptible."""
    return use.job is None or (use.job in jobs and use.job not in yielding)
