"""A [queue] that could not start (its lock held, its database or socket not to be had) is tried again, each
time later (RETRY_FIRST_SECONDS doubling up to RETRY_MAX_SECONDS), with one log line per failed try; until
it starts, `gpu-mon status` says why and when the next try is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

RETRY_FIRST_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


@dataclass
class QueueRetry:
    """Why the queue is not running and when it is tried again."""

    why: str = ""
    delay: float = 0.0  # seconds before the next try
    at: float = 0.0  # the daemon's clock (monotonic) of the next try
    at_wall: float = 0.0  # the same, as wall-clock time (for status)
    tries: int = 0

    def failed(self, why: str, now: float, wall: float) -> float:
        """One more try failed: the delay before the next (doubling, up to RETRY_MAX_SECONDS)."""
        self.tries += 1
        self.delay = min(RETRY_MAX_SECONDS, self.delay * 2 if self.delay else RETRY_FIRST_SECONDS)
        self.why, self.at, self.at_wall = why, now + self.delay, wall + self.delay
        return self.delay

    def due(self, now: float) -> bool:
        """Whether the next try is due."""
        return now >= self.at

    def report(self) -> Tuple[str, float]:
        """(why, when the next try is: wall clock) for the state file."""
        return self.why, self.at_wall


def next_try(retry: Optional[QueueRetry]) -> Optional[float]:
    """The loop's deadline of the next try, if one is owed."""
    return retry.at if retry is not None else None
