"""How a workload is stopped: a signal it may checkpoint on, a grace, then SIGTERM, then SIGKILL.

A stop is a sequence of steps, each a signal to the workload's main process group and a wait: `stop_signal`
(to the main process alone with `main_only`: a queue job's `--stop-main-only`) for the grace (the full
`stop_timeout_seconds`, or `urgent_stop_timeout_seconds` when a foreign process
opened the GPU and is about to allocate memory); then, when `stop_signal` is not SIGTERM, SIGTERM for
TERM_STEP_SECONDS (at most the grace); then SIGKILL to everything the workload started. Pure data: the
supervisor sends the signals.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional, Tuple

from gpu_mon.config import Defaults, ProcessSection

TERM_STEP_SECONDS = 1.0


@dataclass(frozen=True)
class StopRule:
    """A workload's stop settings, resolved against [defaults]."""

    signal: int = signal.SIGTERM
    grace: float = 10.0
    urgent_grace: float = 2.0
    main_only: bool = False  # the first step reaches only the main process (the leader's child)

    def steps(self, urgent: bool) -> Tuple[Tuple[int, float], ...]:
        """(signal, seconds to wait after it) in order; SIGKILL follows the last. With `main_only` the
        first goes to the main process alone, and SIGTERM to every process follows it (even a SIGTERM)."""
        grace = min(self.urgent_grace, self.grace) if urgent else self.grace
        if self.signal == signal.SIGTERM and not self.main_only:
            return ((signal.SIGTERM, grace),)
        return ((self.signal, grace), (signal.SIGTERM, min(TERM_STEP_SECONDS, grace)))


def rule_for(section: Optional[ProcessSection], defaults: Defaults) -> StopRule:
    """The section's stop settings, [defaults]' where it has none."""
    d = defaults
    if section is None:
        return StopRule(grace=d.stop_timeout_seconds, urgent_grace=d.urgent_stop_timeout_seconds)
    grace = section.stop_timeout_seconds or defaults.stop_timeout_seconds
    urgent = section.urgent_stop_timeout_seconds or defaults.urgent_stop_timeout_seconds
    return StopRule(signal=section.stop_signal, grace=grace, urgent_grace=urgent)


def signal_name(signum: int) -> str:
    """`SIGUSR1` for 10."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
