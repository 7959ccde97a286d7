"""What one process tree does with GPUs: which it uses (holds a node of, or NVML lists it on) and how much.

`gpu-mon watch` samples the tree of the command it runs with this; the cost is the tree's size (its
children lists and fd tables) plus one GPU reading, not a scan of every process on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Set

from gpu_mon.api import holders, procfs, usage
from gpu_mon.api.model import GpuReading
from gpu_mon.api.observe import Backend


@dataclass(frozen=True)
class TreeSample:
    """One look at a tree: usage (0.0-1.0, the busiest of its GPUs; 0 when it uses none; None when unsure,
    which counts as busy) and why unsure."""

    pids: FrozenSet[int]
    gpus: Dict[str, Optional[float]] = field(default_factory=dict)  # label -> the tree's usage there
    usage: Optional[float] = 0.0
    error: Optional[str] = None


class TreeObserver:
    """Samples the GPU use of `root` and its descendants."""

    def __init__(self, backend: Backend, root: int, proc: str = procfs.PROC):
        self.backend, self.root, self.proc = backend, root, proc
        self.scanner = holders.HolderScanner(proc)

    def sample(self) -> TreeSample:
        """One look; never raises for a vanished process or an unreadable GPU (that is `error`)."""
        pids = frozenset(procfs.subtree(self.root, self.proc))
        reading = self.backend.read()
        if reading.error:
            return TreeSample(pids, usage=None, error=reading.error)
        targets, _problems = holders.device_targets(reading.gpus)
        self.scanner.set_targets(targets)
        result = self.scanner.only(pids)
        if result.denied:
            return TreeSample(pids, usage=None, error=f"cannot read the open files of pid {result.denied[0]}")
        held: Set[str] = set().union(*result.held.values()) if result.held else set()
        return self._usage(reading, pids, held)

    def _usage(self, reading: GpuReading, pids: FrozenSet[int], held: Set[str]) -> TreeSample:
        gpus: Dict[str, Optional[float]] = {}
        for gpu in reading.gpus:
            listed = any(p.pid in pids for p in gpu.processes or ())
            if gpu.uuid in held or listed:
                gpus[gpu.label] = usage.process_usage(gpu, pids)
        unsure = [label for label, value in gpus.items() if value is None]
        if unsure:
            return TreeSample(pids, gpus, None, f"{unsure[0]} cannot be read")
        return TreeSample(pids, gpus, max(gpus.values(), default=0.0))  # type: ignore[type-var]
