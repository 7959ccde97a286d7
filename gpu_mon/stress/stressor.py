"""One run of the stressor: plan the memory, set up the workload, fill, loop until stopped, release, report.

Budget: the target counts everything the stressor holds (compute buffers, cuBLAS workspace, reduction scratch,
memory blocks). All compute buffers are allocated and exercised once before the blocks fill the rest, so the
loop itself allocates nothing new. Stops: see signals.py (the kernel's default action until the first
allocation, then a flag that every phase checks; the process ends by the signal either way).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

from gpu_mon.stress.fill import Hold
from gpu_mon.stress.loop import Compute
from gpu_mon.stress.plan import StressConfig, UsageError, matrix_size, mib, target_bytes
from gpu_mon.stress.release import release, releases_before_exit
from gpu_mon.stress.report import error, fault, one_line, say
from gpu_mon.stress.signals import StopSignal, die_by, status_after
from gpu_mon.stress.torchdev import cpu_available, identity, import_torch, open_device
from gpu_mon.stress.work import Fault, Work


def run(config: StressConfig, debug: bool = False) -> int:
    """Run the stressor; returns its exit code (0, 1 or 2), or ends the process by the stop signal it got."""
    stop = StopSignal().default()
    stressor = Stressor(config, stop)
    try:
        code = stressor.run()
    except UsageError as exc:
        error(str(exc))
        code = 2
    except Exception as exc:
        if debug:
            raise
        error(f"{config.device}: {one_line(exc)}")
        code = 1
    finally:
        if not stressor.ended:
            release(stressor.hold, stressor.compute)
        stop.restore()
    if stressor.stopped_by is not None:
        return die_by(stressor.stopped_by)
    return code


class Stressor:
    """The state of one run: torch, the device, the workload (Compute) and the memory held (Hold)."""

    def __init__(self, config: StressConfig, stop: StopSignal) -> None:
        self.cfg, self.stop = config, stop
        self.torch: Any = None
        self.device: Any = None
        self.compute: Optional[Compute] = None
        self.hold: Optional[Hold] = None
        self.ended = False  # the exit line is out (and the memory released, as --release asks)
        self.stopped_by: Optional[int] = None  # the signal that ended the run
        self.t0 = time.monotonic()

    def run(self) -> int:
        """Set up and loop; the exit status: 128 + signal when stopped, 0 when done, 1 on a mismatch."""
        cfg = self.cfg
        self.torch = import_torch()
        self.device = open_device(self.torch, cfg.device)
        target, free, capped = self._target()
        dtype = self._dtype()
        size = matrix_size(
            cfg, self.device.type, target, lambda n: Work.workspace_bytes(cfg.workload, dtype, n, cfg.verify)
        )
        compute = self.compute = Compute(cfg, self.stop, self.torch, self.device)
        hold = self.hold = Hold(cfg, self.stop, self.torch, self.device)
        self.stop.catch()  # from here on it holds memory: a stop is released in order
        try:
            if size and self.stop.reason is None:
                size = compute.setup(dtype, size)
            oom = self.stop.reason is None and hold.fill(target, compute)
            if oom:
                hold.back_off(compute)
            if self.stop.reason is not None:
                return self._finish(self.stop.reason)
            self._say_start(target, free, capped or oom, dtype, size)
            reason = compute.run(lambda: hold.held(compute))
            if releases_before_exit(cfg.release, reason):
                compute.drain()
            else:
                compute.pause()
        except Fault as exc:
            fault(self._where(), str(exc))
            return self._finish("fault", 1)
        return self._finish(reason)

    def _target(self) -> Tuple[int, int, bool]:
        """(target bytes, free bytes at start, whether the target was capped to what the host has)."""
        cfg, torch = self.cfg, self.torch
        cpu = self.device.type == "cpu"
        if cfg.assume_free_bytes is not None:
            free = cfg.assume_free_bytes
        elif not cpu:
            free = int(torch.cuda.mem_get_info(self.device)[0])
        else:
            free = cpu_available()
        target, capped = target_bytes(cfg, free, cpu_available() if cpu else None)
        return target, free, capped

    def _dtype(self) -> str:
        """The configured dtype, or the fastest one the device has tensor cores for."""
        if self.cfg.dtype is not None:
            return self.cfg.dtype
        if self.device.type == "cpu":
            return "fp32"
        return "bf16" if self.torch.cuda.get_device_capability(self.device)[0] >= 8 else "fp16"

    def _where(self) -> str:
        """The device for messages: cuda:N with its name and UUID, or cpu."""
        name, uuid = identity(self.torch, self.device)
        return f"{self.device} ({name}, {uuid})" if name else str(self.device)

    def _say_start(self, target: int, free: int, backoff: bool, dtype: str, size: int) -> None:
        """The start line: device, target, what is held and how."""
        cfg, compute, hold = self.cfg, self.compute, self.hold
        work = compute.work
        how = f"{cfg.memory_percent:g}% of free" if cfg.memory_percent is not None else "absolute"
        name, uuid = identity(self.torch, self.device)
        ident = f' name="{name}" uuid={uuid}' if name else ""
        line = (
            f"start device={self.device}{ident} workload={cfg.workload} target_mib={mib(target)} ({how}) "
            f"free_mib={mib(free)} memory_mib={mib(hold.held(compute))} chunks={len(hold.blocks)} "
            f"chunk_mib={mib(hold.block_bytes)} backoff={'yes' if backoff else 'no'} hold={cfg.hold} "
            f"release={cfg.release}"
        )
        if work is not None:
            line += (
                f" dtype={dtype} size={size} workspace_mib={mib(work.nbytes())} "
                f"step_ms={compute.step_ms:.3f} window_iterations={compute.window_iterations} "
                f"verify={'yes' if cfg.verify else 'no'}"
            )
        if cfg.sleep_seconds > 0 and work is not None:
            line += f" compute_seconds={cfg.compute_seconds:g} sleep_seconds={cfg.sleep_seconds:g}"
        say(line)
        self.t0 = compute.t0 = time.monotonic()

    def _finish(self, reason: str, code: int = 0) -> int:
        """Release (as --release asks), print the exit line (memory held after it), return the exit status.

        A stop signal's status is 128 + its number: the process then ends by that signal (run()).
        """
        now = time.monotonic()
        if self.stop.signum is not None and reason == self.stop.reason:
            self.stopped_by, code = self.stop.signum, status_after(self.stop.signum)
        compute, hold = self.compute, self.hold
        rates = compute.rates(now) if compute is not None else ""
        verify = ""
        if self.cfg.verify and compute is not None and compute.work is not None:
            verify = f" verify={'failed' if reason == 'fault' else 'ok'}"
        if releases_before_exit(self.cfg.release, reason):
            release(hold, compute)
        held = hold.held(compute) if hold is not None else 0
        elapsed = now - self.t0
        say(f"exit reason={reason} code={code} elapsed_s={elapsed:.1f}{rates}{verify} memory_mib={mib(held)}")
        self.ended = True
        return code
