"""Idle holders: foreign processes that keep GPU memory without using the GPU (the notebook holding 40 GiB
at 0% for days). Reported only, never signalled. Pure: a snapshot and what was known before in, the
current idle holders and the episodes that started or ended out.

A process is a candidate on a GPU when NVML lists it there with at least `idle_holder_memory_mib` and
its utilization is at most `idle_holder_utilization_pct`: its own per-process samples, or the GPU's when
the driver cannot sample processes and it is the GPU's only process (otherwise unknown: not idle). It is
an idle holder once it has been a candidate for `idle_holder_seconds` in a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

from gpu_mon.api.model import Gpu, GpuProcess, Holder, Snapshot
from gpu_mon.config import GpuSection, GpuSelection
from gpu_mon.policy.decide import ignored

Key = Tuple[int, int, str]  # (pid, start_ticks, uuid)
DEFAULT_RULES = GpuSection(name="(unwatched)", gpus=GpuSelection(all=True))  # GPUs no [gpu-*] names


@dataclass(frozen=True)
class IdleHolder:
    """One process idling on one GPU."""

    pid: int
    user: str
    program: str
    uuid: str
    memory_mib: int
    since: float  # monotonic: first seen idle (in this episode)

    def idle_seconds(self, now: float) -> float:
        """How long it has been idle."""
        return max(0.0, now - self.since)


@dataclass(frozen=True)
class IdleTrack:
    """What the tracker remembers: candidates (idle, not yet for long enough) and current idle holders."""

    candidates: Mapping[Key, IdleHolder]
    current: Mapping[Key, IdleHolder]


def utilization(gpu: Gpu, p: GpuProcess) -> Optional[float]:
    """The process's utilization (percent), the GPU's when it is alone there and unsampled, else None."""
    if p.utilization_pct is not None:
        return float(p.utilization_pct)
    if len(gpu.processes or ()) == 1 and gpu.utilization_pct is not None:
        return float(gpu.utilization_pct)
    return None


def _candidate(gpu: Gpu, p: GpuProcess, h: Optional[Holder], rules: GpuSection) -> bool:
    if h is not None and (h.ours_on(gpu.uuid) or ignored(h, rules)):
        return False
    util = utilization(gpu, p)
    memory = p.used_memory_mib
    return (
        memory is not None
        and util is not None
        and memory >= rules.idle_holder_memory_mib
        and (util <= rules.idle_holder_utilization_pct)
    )


def track(
    rules_of: Mapping[str, GpuSection], snap: Snapshot, old: IdleTrack
) -> Tuple[IdleTrack, Tuple, Tuple]:
    """(the new track, idle holders that started an episode, those whose episode ended)."""
    seen = old.candidates
    candidates: Dict[Key, IdleHolder] = {}
    for gpu in snap.reading.gpus:
        if not gpu.uuid:
            continue
        by_pid = {h.pid: h for h in snap.nvml_procs if gpu.uuid in h.gpus}
        rules = rules_of.get(gpu.uuid, DEFAULT_RULES)
        for p in gpu.processes or ():
            h = by_pid.get(p.pid)
            if not _candidate(gpu, p, h, rules):
                continue
            key = (p.pid, h.start_ticks if h else 0, gpu.uuid)
            first = seen[key].since if key in seen else snap.now
            user, program = (h.user, h.name) if h else ("?", "?")
            candidates[key] = IdleHolder(p.pid, user, program, gpu.uuid, int(p.used_memory_mib or 0), first)
    current = {
        k: c
        for k, c in candidates.items()
        if c.idle_seconds(snap.now) >= rules_of.get(k[2], DEFAULT_RULES).idle_holder_seconds
    }
    started = tuple(c for k, c in current.items() if k not in old.current)
    ended = tuple(c for k, c in old.current.items() if k not in current)
    return IdleTrack(candidates, current), started, ended
