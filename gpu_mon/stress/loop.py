"""The compute side of a run: the workload's set-up, its windows of GPU work, the duty cycle and its reports.

A window is ~25 ms of GPU work; at most two are queued on the stream, so a stop waits for at most ~50 ms of
kernels. The loop checks the stop flag between windows and allocates nothing (every buffer exists by then).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, List, Optional, Tuple

from gpu_mon.stress.plan import MIN_AUTO_SIZE, StressConfig, mib
from gpu_mon.stress.report import figure, say
from gpu_mon.stress.signals import StopSignal
from gpu_mon.stress.work import Fault, Work

WINDOW_SECONDS = 0.025


class Compute:
    """The workload (None for --workload none) and the counters of its loop."""

    def __init__(self, config: StressConfig, stop: StopSignal, torch: Any, device: Any) -> None:
        self.cfg, self.stop, self.torch, self.device = config, stop, torch, device
        self.work: Optional[Work] = None
        self.events: List[Any] = []
        self.inflight: List[Tuple[int, int, int]] = []  # (slot, first, last iteration) launched, not retired
        self.iterations = self.completed = self.windows = 0
        self.window_iterations = 1
        self.step_ms = 0.0
        self.looping = False  # iterations are numbered (and faults injected) from the loop's start
        self.busy_seconds = 0.0
        self.busy_since: Optional[float] = None
        self.t0 = time.monotonic()
        self.marks = (0, 0.0)  # (completed iterations, busy seconds) at the last report

    def setup(self, dtype: str, size: int) -> int:
        """Set up the workload, halving a default size while a step outlasts two windows; returns the size.

        A stop during the set-up ends it early (the caller sees the flag and releases what was allocated).
        """
        while True:
            step_seconds = self._build(dtype, size)
            if self.stop.reason is not None:
                return size
            if step_seconds <= 2 * WINDOW_SECONDS or self.cfg.size is not None or size <= MIN_AUTO_SIZE:
                break
            size //= 2  # a slow device: 8x less work per step keeps a stop prompt
            self.clear()
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
        self.window_iterations = max(1, min(1000, int(WINDOW_SECONDS / step_seconds)))
        self.step_ms = step_seconds * 1e3
        self.flush(0)
        self.sync()
        self.check(0, "warm-up")
        return size

    def _build(self, dtype: str, size: int) -> float:
        """Allocate the workload and run every kernel of the loop once; returns the seconds of one step."""
        torch, cfg = self.torch, self.cfg
        self.work = Work(torch, self.device, cfg.workload, dtype, size)
        if self.device.type == "cuda":
            self.events = [torch.cuda.Event(blocking=True) for _ in range(2)]  # blocking: no CPU spin
        if cfg.verify:
            self.work.enable_verify()
        if cfg.inject_fault_at is not None:
            self.work.corrupt(0.0)  # load its kernel now, not on a full device
        self.iterate(2)  # first launches load kernels and create the cuBLAS workspace
        self.sync()
        start, count = time.perf_counter(), 0
        while count < 1 or (time.perf_counter() - start < 0.05 and count < 1000 and self.stop.reason is None):
            self.iterate(1)
            self.sync()
            count += 1
        return (time.perf_counter() - start) / count

    def clear(self) -> None:
        """Drop the workload's buffers and events."""
        self.work = None
        self.events = []

    def iterate(self, count: int) -> None:
        """Launch `count` steps (with fault injection and error folding as configured)."""
        work, cfg = self.work, self.cfg
        for _ in range(count):
            self.iterations += 1
            work.step()
            if self.looping and self.iterations == cfg.inject_fault_at:
                work.corrupt()
            if cfg.verify:
                work.accumulate_error()

    def sync(self) -> None:
        """Wait for all launched work on the device."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def flush(self, slot: int) -> None:
        """Queue the verify error of the current window to host buffer `slot`."""
        if self.cfg.verify:
            self.work.flush_error(slot)

    def check(self, slot: int, span: str) -> None:
        """Raise Fault when the finished window in `slot` exceeds the tolerance."""
        if not self.cfg.verify:
            return
        work = self.work
        error = work.window_error(slot)
        if not error <= work.tolerance:  # NaN fails too
            raise Fault(
                f"wrong {work.kind} results in {span}: max_abs_error={error:.6g} > "
                f"tolerance={work.tolerance:.6g} ({work.dtype}, n={work.size})"
            )

    def run(self, held: Callable[[], int]) -> str:
        """Compute (or idle) until a signal or --duration; returns why it ended. `held`: bytes held now."""
        cfg, now = self.cfg, self.t0
        end = now + cfg.duration_seconds if cfg.duration_seconds is not None else math.inf
        next_report = now + cfg.report_seconds
        phase = "compute" if self.work is not None else "idle"
        phase_end = now + cfg.compute_seconds if phase == "compute" and cfg.sleep_seconds > 0 else math.inf
        self.busy_since = now if phase == "compute" else None
        self.iterations = self.completed = 0
        self.looping = True
        self.marks = (0, 0.0)
        while True:
            if self.stop.reason is not None:
                return self.stop.reason
            now = time.monotonic()
            if now >= end:
                return "duration"
            if now >= phase_end:
                if phase == "compute":
                    self.drain()
                    phase, phase_end = "sleep", time.monotonic() + cfg.sleep_seconds
                else:
                    phase, phase_end = "compute", now + cfg.compute_seconds
                    self.busy_since = now
                continue
            if now >= next_report:
                self._report(now, phase, held())
                next_report = max(next_report + cfg.report_seconds, now + cfg.report_seconds / 2)
            if phase == "compute":
                self._window()
            else:
                self.stop.wait(min(end, phase_end, next_report) - now)

    def _window(self) -> None:
        """Launch one window of work, then wait until the window before it has finished."""
        slot, first = self.windows % 2, self.iterations + 1
        self.iterate(self.window_iterations)
        self.flush(slot)
        if self.events:
            self.events[slot].record()
        self.inflight.append((slot, first, self.iterations))
        self.windows += 1
        while len(self.inflight) > 1:
            self._retire()

    def _retire(self) -> None:
        """Wait for the oldest launched window and check its results."""
        slot, first, last = self.inflight.pop(0)
        if self.events:
            self.events[slot].synchronize()
        self.completed = last
        self.check(slot, f"iterations {first}-{last}")

    def drain(self) -> None:
        """Wait for every launched window; close the busy interval."""
        while self.inflight:
            self._retire()
        self.pause()

    def pause(self) -> None:
        """Close the busy interval (its windows are left to finish on their own)."""
        if self.busy_since is not None:
            self.busy_seconds += time.monotonic() - self.busy_since
            self.busy_since = None

    def _busy(self, now: float) -> float:
        """Seconds spent in compute phases so far."""
        return self.busy_seconds + (now - self.busy_since if self.busy_since is not None else 0.0)

    def rates(self, now: float, since: Tuple[int, float] = (0, 0.0)) -> str:
        """Throughput fields for the iterations completed since `since` (iterations, busy seconds)."""
        if self.work is None:
            return ""
        iterations, seconds = self.completed - since[0], self._busy(now) - since[1]
        tflops = iterations * self.work.flops / seconds / 1e12 if seconds > 0 else 0.0
        line = f" iterations={self.completed} tflops={figure(tflops, 3)}"
        if self.work.kind == "elementwise":
            gb_per_s = iterations * self.work.bytes_moved / seconds / 1e9 if seconds > 0 else 0.0
            line += f" gb_per_s={figure(gb_per_s, 1)}"
        return line

    def _report(self, now: float, phase: str, held: int) -> None:
        """A periodic line: phase, throughput since the last report, memory held."""
        since, self.marks = self.marks, (self.completed, self._busy(now))
        rates = self.rates(now, since)
        say(f"report elapsed_s={now - self.t0:.1f} phase={phase}{rates} memory_mib={mib(held)}")
