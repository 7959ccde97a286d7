"""Holding memory: allocations that fill the target as --hold asks, and the back-off after an out-of-memory.

The target counts everything the stressor holds (compute buffers, cuBLAS workspace, reduction scratch and
these blocks), so the fill comes after the workload's set-up and tops the memory up to the target.
"""

from __future__ import annotations

from typing import Any, List, Optional

from gpu_mon.stress.loop import Compute
from gpu_mon.stress.plan import CUDA_MIN_CHUNK, CUDA_ROUND, MIB, OOM_MIN_CHUNK, StressConfig, chunk_bytes
from gpu_mon.stress.signals import StopSignal
from gpu_mon.stress.torchdev import is_oom

# On cpu a block's pages are written in slices this large, with a look at the stop flag between them: a
# 16 GiB block (--hold one) takes seconds to write, and a stop must not wait for all of it.
CPU_FILL_SLICE = 64 * MIB


class Hold:
    """The blocks of memory held beyond the workload's own buffers."""

    def __init__(self, config: StressConfig, stop: StopSignal, torch: Any, device: Any) -> None:
        self.cfg, self.stop, self.torch, self.device = config, stop, torch, device
        self.blocks: List[Any] = []
        self.block_bytes = config.chunk_bytes  # the size the fill started with (the start line's chunk_mib)

    @property
    def cuda(self) -> bool:
        """Whether the blocks are device memory (else host memory)."""
        return self.device.type == "cuda"

    def held(self, compute: Optional[Compute]) -> int:
        """Bytes held now: what the CUDA allocator has reserved, or our CPU tensors."""
        if self.cuda:
            return int(self.torch.cuda.memory_reserved(self.device))
        work = compute.work.nbytes() if compute is not None and compute.work is not None else 0
        return work + sum(block.numel() for block in self.blocks)

    def fill(self, target: int, compute: Optional[Compute]) -> bool:
        """Allocate blocks until the memory held reaches the target; returns True if an allocation failed.

        Stops at once on a stop signal (a block being written on cpu is dropped).
        """
        torch = self.torch
        size = self.block_bytes = chunk_bytes(self.cfg, max(0, target - self.held(compute)), self.cuda)
        oom = False
        while self.stop.reason is None:
            want = min(size, target - self.held(compute))
            if self.cuda:
                want = want // CUDA_ROUND * CUDA_ROUND
                if want < CUDA_MIN_CHUNK:
                    break
            elif want <= 0:
                break
            try:
                block = torch.empty(want, dtype=torch.uint8, device=self.device)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                oom = True
                if size <= OOM_MIN_CHUNK:
                    break
                size //= 2
                continue
            if not self.cuda and not self._write(block):
                break
            self.blocks.append(block)
        return oom

    def _write(self, block: Any) -> bool:
        """Make a cpu block resident (pages exist only once written); False when a stop came first."""
        for start in range(0, block.numel(), CPU_FILL_SLICE):
            if self.stop.reason is not None:
                return False
            block[start : start + CPU_FILL_SLICE].fill_(0x5A)
        return True

    def back_off(self, compute: Optional[Compute]) -> None:
        """After an out-of-memory: give back a block as slack and re-run the loop's work until it fits."""
        while True:
            if self.blocks:
                self.blocks.pop()
            if self.cuda:
                self.torch.cuda.empty_cache()  # the failed allocation also emptied the scratch cache
            if compute is None or compute.work is None:
                return
            try:
                compute.iterate(1)
                compute.flush(0)
                compute.sync()
                compute.check(0, "warm-up")
                return
            except Exception as exc:
                if not (is_oom(exc) and self.blocks):
                    raise
