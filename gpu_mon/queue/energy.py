"""A run's energy on each of its GPUs, from NVML's total energy counter (millijoules since the driver
loaded) read at its start and at its end; where a GPU has no counter (NOT_SUPPORTED: before Volta, or not
a data-centre GPU), from its power samples (milliwatts) integrated over the rounds it ran (trapezoids
between two looks). Pure: the queue's records (runrecords.py) keep the figures, this module counts them.

A counter lower at the end than at the start means the driver was reloaded during the run (it counts from
0 again): the run's energy is then the counter at its end, what was used since the reload, a lower bound,
and the GPU's figure says so (`"reset": true`). A figure that cannot be known is None, never 0.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple

from gpu_mon.api.model import Gpu

GpuEnergy = Dict[str, object]  # one GPU's figures in a run record (see `energy_of`)


def counters(gpus: Iterable[Gpu], uuids: Iterable[str]) -> Dict[str, Optional[int]]:
    """NVML's energy counter of each of these GPUs in one look (None: no counter, or not in the look)."""
    by_uuid = {g.uuid: g.energy_mj for g in gpus}
    return {u: by_uuid.get(u) for u in uuids}


def used(start: Optional[int], end: Optional[int]) -> Tuple[Optional[int], bool]:
    """Millijoules between two readings of a counter, and whether it went down (a driver reload: the
    figure is then what was used since the reload). None: either reading is missing."""
    if start is None or end is None:
        return None, False
    if end < start:
        return end, True
    return end - start, False


def energy_of(gpu: Mapping[str, object]) -> Tuple[Optional[float], bool]:
    """One GPU's energy in a run (millijoules) from its record (`start_mj`, `end_mj`: the counter;
    `sampled_mj`: power integrated) and whether it is a lower bound (a driver reload)."""
    got, reset = used(_int(gpu.get("start_mj")), _int(gpu.get("end_mj")))
    if got is not None:
        return float(got), reset
    sampled = gpu.get("sampled_mj")
    return (float(sampled), False) if isinstance(sampled, (int, float)) else (None, False)


def total(per_gpu: Mapping[str, Mapping[str, object]]) -> Optional[float]:
    """A run's energy over all its GPUs (millijoules); None when any GPU's is unknown (a partial sum would
    read as the whole)."""
    figures = [energy_of(g)[0] for g in per_gpu.values()]
    if not figures or any(f is None for f in figures):
        return None
    return float(sum(f for f in figures if f is not None))


class Meter:
    """Power integrated over time, per GPU, for the GPUs without a counter: `sample` each look adds the
    trapezoid since the look before (a GPU without a power figure in a look starts again at the next)."""

    def __init__(self) -> None:
        self.last: Dict[str, Tuple[float, int]] = {}  # GPU -> (monotonic seconds, milliwatts) last seen

    def sample(self, gpus: Iterable[Gpu], now: float) -> Dict[str, float]:
        """The millijoules each GPU used since the last sample (only GPUs with power in both)."""
        out: Dict[str, float] = {}
        seen: Dict[str, Tuple[float, int]] = {}
        for g in gpus:
            if g.uuid is None or g.power_mw is None:
                continue
            seen[g.uuid] = (now, g.power_mw)
            before = self.last.get(g.uuid)
            if before is not None and now > before[0]:
                out[g.uuid] = (now - before[0]) * (before[1] + g.power_mw) / 2.0
        self.last = seen
        return out


def _int(value: object) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
