"""What one round of the daemon saw, decided and did: the data every listener (outputs/) is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.config import Config
from gpu_mon.policy.decisions import Decision, Preemption
from gpu_mon.policy.idleholders import IdleHolder


@dataclass(frozen=True)
class RoundReport:
    """Everything one round saw, decided and did, for the listeners."""

    config: Config
    plan: object  # policy.Plan
    snapshot: Snapshot
    decision: Decision
    workloads: Tuple[dict, ...]  # the supervisor's view of each live workload (key, label, gpus, pid...)
    said: Tuple[dict, ...]  # recent decisions as logged: {"wall": ..., "text": ...}
    daemon: dict  # pid, start_ticks, started_wall, containment
    source: str  # "" for NVML, else where the simulated GPUs come from
    wall: float  # time.time() of the round
    preemptions: Tuple[Preemption, ...] = ()  # yields completed in this round
    idle_holders: Tuple[IdleHolder, ...] = ()  # current idle holders
    idle_started: Tuple[IdleHolder, ...] = ()  # idle-holder episodes that began in this round
    idle_ended: Tuple[IdleHolder, ...] = ()  # ... and that ended
    scans: Tuple[Tuple[str, float], ...] = ()  # (mode, seconds) of the holder scans since the last round
    queue: Optional[object] = None  # [queue]: queue/runs.QueueReport (None without a queue)
    queue_down: Optional[Tuple[str, float]] = None  # a [queue] that could not start: why, next try (wall)
    slurm: Optional[object] = None  # [slurm]: slurm/view.SlurmReport (None without [slurm])
