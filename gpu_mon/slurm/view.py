"""What the Slurm hook tells the outputs after each round (status, history, metrics): plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class JobOnGpus:
    """A Slurm job whose processes hold GPUs of this node."""

    job: int
    user: str
    partition: str
    qos: str
    preemptible: Optional[bool]  # None: Slurm has not described the job yet
    gpus: Tuple[str, ...]  # UUIDs
    doing: str = ""  # what gpu-mon asked of Slurm for it: "", signalled, requeue, cancel, requeued, ...
    allocated: Tuple[str, ...] = ()  # UUIDs of the GPUs among `gpus` that Slurm allocated to it


@dataclass(frozen=True)
class Action:
    """One action gpu-mon asked Slurm for, and how it went."""

    wall: float
    job: int
    user: str
    partition: str
    gpu: str  # UUID of the GPU someone else used
    by: str  # who used it: `alice python3[4242]`
    action: str  # signal, requeue, cancel
    result: str  # ok, failed, unreachable, gone
    issued_ms: Optional[float]  # from the wake that saw the use (the open, or a poll) to the command's start
    seen_by: str = "poll"  # open or poll
    error: str = ""


@dataclass(frozen=True)
class SlurmReport:
    """The Slurm side of a round."""

    jobs: Tuple[JobOnGpus, ...] = ()
    actions: Tuple[Action, ...] = ()  # finished since the last round
    counts: Tuple[Tuple[str, str, int], ...] = ()  # (action, result, total since gpu-mon started)
    unreachable: bool = False  # the last call found slurmctld unreachable
    episodes: int = 0  # unreachable episodes since gpu-mon started
