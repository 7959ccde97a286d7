"""GPU usage as a fraction (0.0-1.0): of whole GPUs, of some processes on a GPU, or of everyone but us.

The rules are pure functions of a GpuReading; `get_gpu_usage` (seed 001's name) reads the GPUs itself.
None always means "could not be read": callers treat it as activity, never as idle.
"""

from __future__ import annotations

import os
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Union

from gpu_mon.api.model import Gpu, GpuReading
from gpu_mon.api.observe import Backend

GpuRef = Union[int, str]  # NVML index, or UUID
AGGREGATES = ("mean", "max")


class GpuUsageError(RuntimeError):
    """The GPUs could not be read (no driver, a lost GPU, a bad sim file); str() is one line."""


def select(reading: GpuReading, refs: Optional[Sequence[GpuRef]]) -> List[Gpu]:
    """The GPUs named by NVML index or UUID (None: all); GpuUsageError for one that is not there."""
    if reading.error:
        raise GpuUsageError(reading.error)
    if refs is None:
        return list(reading.gpus)
    out = []
    for ref in refs:
        found = [g for g in reading.gpus if _named(g, ref)]
        if not found:
            raise GpuUsageError(f"no GPU {ref!r} (this host has {len(reading.gpus)}: indices from 0)")
        out.append(found[0])
    return out


def _named(gpu: Gpu, ref: GpuRef) -> bool:
    if isinstance(ref, str):
        return (gpu.uuid or "").lower() == ref.lower()  # NVML spells UUIDs in lower case
    return gpu.index == ref


def device_usage(gpu: Gpu) -> Optional[float]:
    """The whole GPU's utilization, or None when it could not be read."""
    if gpu.utilization_pct is None or any(e.startswith(("gpu:", "utilization:")) for e in gpu.errors):
        return None
    return gpu.utilization_pct / 100


def sampled(gpu: Gpu) -> bool:
    """Whether the driver reported per-process utilization on this GPU in this look."""
    return any(p.utilization_pct is not None for p in gpu.processes or ())


def process_usage(gpu: Gpu, pids: Collection[int]) -> Optional[float]:
    """Utilization of these processes on this GPU: the sum of their own samples where the driver has
    per-process samples, else the whole GPU's utilization (they may be all of it); None if unreadable."""
    if gpu.processes is None:
        return None
    mine = [p for p in gpu.processes if p.pid in pids]
    if sampled(gpu) and all(p.utilization_pct is not None for p in mine):
        return min(1.0, sum(p.utilization_pct or 0 for p in mine) / 100)
    return device_usage(gpu)


def foreign_usage(gpu: Gpu, ours: Collection[int], occupied: bool) -> Optional[float]:
    """Utilization by processes that are not `ours`. Without per-process samples, a GPU one of our
    workloads occupies counts 0 (anyone else there would have made it yield), any other its whole usage."""
    if gpu.processes is None:
        return None
    others = [p.pid for p in gpu.processes if p.pid not in ours]
    if sampled(gpu):
        return process_usage(gpu, others)
    return 0.0 if occupied and device_usage(gpu) is not None else device_usage(gpu)


def aggregate(values: Iterable[Optional[float]], how: str = "mean") -> Optional[float]:
    """mean or max of the values; None if any is None (unsure means active) or there are none."""
    got = list(values)
    if not got or any(v is None for v in got):
        return None
    numbers = [float(v) for v in got if v is not None]
    return max(numbers) if how == "max" else sum(numbers) / len(numbers)


def per_gpu(gpus: Iterable[Gpu]) -> Dict[str, Optional[float]]:
    """{label: device usage} (for log lines)."""
    return {g.label: device_usage(g) for g in gpus}


_DEFAULT: Optional[Backend] = None


def default_backend() -> Backend:
    """The simulated GPUs of $GPU_MON_SIM when it is set, else NVML (made once, kept for later calls)."""
    global _DEFAULT
    if _DEFAULT is None:
        sim = os.environ.get("GPU_MON_SIM")
        if sim:
            from gpu_mon.api.sim import SimBackend

            _DEFAULT = SimBackend(sim, create_devices=False)
        else:
            from gpu_mon.api.nvml import NvmlBackend

            _DEFAULT = NvmlBackend()
    return _DEFAULT


def get_gpu_usage(
    device_ids: Optional[Sequence[GpuRef]] = None, backend: Optional[Backend] = None, how: str = "mean"
) -> float:
    """Mean utilization (0.0-1.0) of these GPUs (NVML indices or UUIDs; None: all of them).

    Raises GpuUsageError when any of them cannot be read, or there is none: the caller decides what that
    means (a monitoring error is never a silent 0)."""
    if how not in AGGREGATES:
        raise ValueError(f"how must be one of {', '.join(AGGREGATES)}")
    gpus = select((backend or default_backend()).read(), device_ids)
    if not gpus:
        raise GpuUsageError("no GPU found")
    value = aggregate((device_usage(g) for g in gpus), how)
    if value is None:
        bad = next(g for g in gpus if device_usage(g) is None)
        raise GpuUsageError(f"{bad.label}: {'; '.join(bad.errors) or 'utilization unreadable'}")
    return value
