"""The occupier's phase, for `gpu-mon occupy status`: waiting, occupying or yielded, and since when.

A round listener: it only writes `phase.json` (atomically, when the phase changes); it never steers.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Tuple

from gpu_mon.outputs import statefile
from gpu_mon.policy.report import RoundReport


def next_phase(report: RoundReport, polite: bool, occupied: bool) -> Tuple[str, bool]:
    """(the phase, whether it has occupied yet) after this round."""
    if any(not w.get("stopping") for w in report.workloads):
        return "occupying", True
    if polite and occupied:
        return "yielded", True  # gave the GPUs back to someone else; takes them again after the wait
    return "waiting", occupied


class PhaseFile:
    """waiting (never occupied yet, or after a crash), occupying, yielded (gave the GPUs back, waits)."""

    def __init__(self, path: str, polite: bool):
        self.path, self.polite = path, polite
        self.phase: Optional[str] = None
        self.occupied = False

    def on_round(self, report: RoundReport) -> None:
        """Work the phase out of the round; write it when it changed."""
        phase, self.occupied = next_phase(report, self.polite, self.occupied)
        if phase != self.phase:
            self.phase = phase
            statefile.write(self.path, {"phase": phase, "since_wall": round(report.wall, 3)})

    def on_event(self, event: str) -> None:
        """Gone with the occupier."""
        if event == "stopped":
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def deadline(self) -> Optional[float]:
        """No watchdog."""
        return None
