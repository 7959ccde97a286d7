"""[occupy] max_hold_hours inside the occupier: once it has held its GPUs that long (counted from when it
first occupies them, time spent yielded included), it says why in its log and ends as SIGTERM would: every
workload stopped, then exit 0. The limit comes from the system config at `occupy on`, not from options.

A round listener with a deadline, so that the loop wakes exactly when the time is up.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")


class HoldLimit:
    """Calls `end` once, `hours` after the first round with a running workload."""

    def __init__(
        self, hours: float, where: str, end: Callable[[], None], clock: Callable[[], float] = time.monotonic
    ):
        self.hours, self.where, self.end, self.clock = hours, where, end, clock
        self.began: Optional[float] = None
        self.done = False

    def on_round(self, report: RoundReport) -> None:
        """Start counting at the first round that holds the GPUs."""
        if self.began is None and any(not w.get("stopping") for w in report.workloads):
            self.began = self.clock()

    def on_event(self, event: str) -> None:
        """On every wake: end the occupier once the time is up."""
        due = self.deadline()
        if event == "alive" and due is not None and self.clock() >= due:
            self.done = True
            log.info(
                "occupy: held the GPUs for %g h, the most the admin allows ([occupy] max_hold_hours in %s): "
                "giving them back and exiting",
                self.hours,
                self.where,
            )
            self.end()

    def deadline(self) -> Optional[float]:
        """When the hold ends (None before it began and after it ended)."""
        if self.began is None or self.done:
            return None
        return self.began + self.hours * 3600
