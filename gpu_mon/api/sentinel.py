"""The idle sentinel's state machine (seed 001's `Sentinel`): arm on activity, act once when idle.

Pure: no clock, no I/O. It counts ticks, not seconds; the caller ticks at its own pace:

    sentinel = Sentinel(arm_duration=10, arm_threshold=0.7, kill_duration=60, kill_threshold=0.1,
                        kill_fn=lambda: print("idle"))
    while True:
        sentinel.tick(get_gpu_usage())
        time.sleep(1)

`waiting`: until usage >= arm_threshold for `arm_duration` ticks in a row, then `armed`. `armed`: when usage
< kill_threshold for `kill_duration` ticks in a row, `kill_fn` is called once and the state is `fired`.
`fired` waits to re-arm exactly as `waiting` does (the original called kill_fn again on every later tick).
A tick with usage None (the GPUs could not be read) counts as activity for the idle count (a monitoring
error never leads to the action) but not towards arming.
"""

from __future__ import annotations

from typing import Callable, Optional

WAITING, ARMED, FIRED = "waiting", "armed", "fired"


class Sentinel:
    """Arm after `arm_duration` busy ticks; call `kill_fn` once after `kill_duration` idle ticks."""

    def __init__(
        self,
        arm_duration: int,
        arm_threshold: float,
        kill_duration: int,
        kill_threshold: float,
        kill_fn: Callable[[], object],
    ):
        for name, value in (("arm_duration", arm_duration), ("kill_duration", kill_duration)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number of ticks >= 0, not {value!r}")
        for name, value in (("arm_threshold", arm_threshold), ("kill_threshold", kill_threshold)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ValueError(f"{name} must be a fraction from 0 to 1, not {value!r}")
        self.arm_duration = arm_duration
        self.arm_threshold = float(arm_threshold)
        self.kill_duration = kill_duration
        self.kill_threshold = float(kill_threshold)
        self.kill_fn = kill_fn
        self.state = ARMED if arm_duration == 0 else WAITING
        self.busy_ticks = 0  # consecutive ticks at or above arm_threshold (while not armed)
        self.idle_ticks = 0  # consecutive ticks below kill_threshold (while armed)

    def tick(self, usage: Optional[float]) -> str:
        """Advance one tick with this usage (0.0-1.0, or None when unknown); return the state after it."""
        if self.state == ARMED:
            self._armed_tick(usage)
        else:
            self._waiting_tick(usage)
        return self.state

    def _waiting_tick(self, usage: Optional[float]) -> None:
        self.busy_ticks = self.busy_ticks + 1 if usage is not None and usage >= self.arm_threshold else 0
        if self.busy_ticks >= self.arm_duration:
            self.state, self.busy_ticks, self.idle_ticks = ARMED, 0, 0

    def _armed_tick(self, usage: Optional[float]) -> None:
        self.idle_ticks = self.idle_ticks + 1 if usage is not None and usage < self.kill_threshold else 0
        if self.idle_ticks >= max(1, self.kill_duration):
            self.state, self.busy_ticks, self.idle_ticks = FIRED, 0, 0
            self.kill_fn()

    def __repr__(self) -> str:
        return (
            f"Sentinel(state={self.state!r}, busy_ticks={self.busy_ticks}, idle_ticks={self.idle_ticks}, "
            f"arm={self.arm_duration}x>={self.arm_threshold:g}, "
            f"kill={self.kill_duration}x<{self.kill_threshold:g})"
        )
