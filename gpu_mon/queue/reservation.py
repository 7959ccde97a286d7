"""Pure backfill arithmetic: when each queue GPU is next ready for a job, the head's reservation, and the
estimated start of the jobs behind it (as Slurm's backfill scheduler and `squeue --start`).

A GPU's ready time is wall-clock: now (plus what is left of its start delay) for a free one, the end of the
time limit of the job on it (plus the start delay) for one of ours, UNKNOWN where no end is known (a job
without a time limit). Its rank says whose it is where times tie: free or ours first, then the GPUs that are
not ours to promise (a foreign user's, a [process-*] workload's the queue may not stop). No I/O, no clock;
each look is O(GPUs log GPUs), so estimating the first K waiting jobs is O(K * GPUs log GPUs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

UNKNOWN = math.inf  # a ready time nobody can tell (a job without a time limit, someone else's use)
OURS, NOT_OURS = 0, 1  # ranks: a GPU the queue can promise (free or a job's), one it cannot
ESTIMATED = 500  # waiting jobs given an estimated start per placement, at most (Slurm's bf_max_job_test)


@dataclass(frozen=True)
class Reservation:
    """The GPUs the head of the order will get first, and when (wall-clock; None: unknown, any moment)."""

    job: int
    gpus: Tuple[str, ...]
    start: Optional[float]


class Timeline:
    """Each GPU's next ready time, booked forward job by job in the order of the queue."""

    def __init__(self, ready: Dict[str, Tuple[float, int]]) -> None:
        self.ready = dict(ready)  # uuid -> (wall time or UNKNOWN, rank)
        self._order = {u: i for i, u in enumerate(ready)}  # (ties: the queue's GPU order)

    def earliest(self, wanted: int) -> List[str]:
        """The `wanted` GPUs ready first (ours before others' at equal times)."""
        key = self.ready.__getitem__
        return sorted(self.ready, key=lambda u: (*key(u), self._order[u]))[:wanted]

    def start_on(self, gpus: List[str]) -> Optional[float]:
        """When a job could start on these GPUs (None: unknown)."""
        at = max((self.ready[u][0] for u in gpus), default=UNKNOWN)
        return None if at == UNKNOWN else at

    def promised(self, gpus: List[str]) -> bool:
        """Whether every one of these GPUs is the queue's to promise."""
        return all(self.ready[u][1] == OURS for u in gpus)

    def book(self, gpus: List[str], start: Optional[float], run: Optional[float], delay: float) -> None:
        """A job starts on these GPUs at `start` and runs at most `run` seconds (None: unknown): they are
        ready for the next one after it, and after the start delay (a GPU booked later already, kept for
        the head and taken by a backfill, stays as the head booked it)."""
        end = UNKNOWN if start is None or run is None else start + run + delay
        for u in gpus:
            self.ready[u] = (max(end, self.ready[u][0]), OURS)

    def all_unknown(self) -> bool:
        """Whether no GPU has a known ready time left (every later estimate is unknown)."""
        return all(t == UNKNOWN for t, _rank in self.ready.values())


def fits_before(start: float, run: Optional[float], delay: float, reservation: Reservation) -> bool:
    """Whether a job that starts at `start` and runs at most `run` seconds leaves a reserved GPU ready
    (its start delay over) by the reservation's start: only then may it use one."""
    if run is None or reservation.start is None:
        return False
    return start + run + delay <= reservation.start
