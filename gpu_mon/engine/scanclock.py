"""Which scan of /proc is due, and when: the daemon's timetable of looks. It calls nothing; the loop asks
`due()` for a mode and tells it what ran.

- a poll every interval_seconds (NVML read, then new processes, holders and young ones looked at);
- within a poll, every process's fd signature compared every SIGNATURE_SECONDS, at every poll where opens
  cannot all be watched, and at once when NVML shows use the holders found do not explain ("changed");
- a full scan (memory maps included) every full_scan_seconds, or asked for with SIGUSR2 ("full");
- a full scan of fd tables soon after a holder let go or an open's explainer was found ("deferred": at most
  two a second, later ones are deferred, never dropped), or after an open no look explained;
- a scan that paused for an open goes on once that open is handled ("owed");
- per-process utilization read every UTILIZATION_POLLS-th poll, at least every UTILIZATION_SECONDS.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from gpu_mon.config import Defaults

EVENT_FULL_SCAN_GAP = 0.5  # at most two unexplained-open full scans a second
SIGNATURE_SECONDS = 10.0  # every process's fd signature compared at least this often (a poll's own cost)
# Per-process utilization (status, idle holders, [sentinel]) is read every 5th poll, at least every 10 s,
# and carried between: NVML's call costs 1.4 ms a GPU on an H200 (driver 580), 90% of a whole look.
UTILIZATION_SECONDS, UTILIZATION_POLLS = 10.0, 5

# due()'s modes
OWED, FULL_POLL, POLL, DEFERRED = "owed", "full poll", "poll", "deferred"


class ScanClock:
    """The next time of each kind of scan."""

    def __init__(self, defaults: Defaults):
        self.defaults = defaults  # (a reload brings new ones)
        self.next_poll = 0.0
        self.next_utilization = 0.0
        self.next_full = 0.0
        self.next_signatures = 0.0
        self.full_requested = False  # SIGUSR2
        self.deferred_full: Optional[float] = None
        self.last_event_full = -1e9
        self.last_early_poll = -1e9
        self.again_at: Optional[float] = None  # a poll after one brought forward (the driver's late release)
        self.owed: Optional[str] = None  # the mode of a scan that paused for an open
        self.every_next = False  # the next full scan reads every process (see Observer.scan)

    def deadlines(self) -> Tuple[Optional[float], ...]:
        """When the loop must wake for a scan (a scan that paused goes on at once)."""
        return (self.next_poll, self.again_at, self.deferred_full, 0.0 if self.owed is not None else None)

    def due(self, now: float) -> Optional[str]:
        """The scan this wake owes, if any: OWED, FULL_POLL, POLL or DEFERRED."""
        if self.owed is not None:
            return OWED
        again = self.again_at is not None and now >= self.again_at
        if now >= self.next_poll or self.full_requested or again:
            return FULL_POLL if now >= self.next_full or self.full_requested else POLL
        if self.deferred_full is not None and now >= self.deferred_full:
            return DEFERRED
        return None

    def poll_now(self, now: float) -> None:
        """A poll at this wake (a reload, a queue that started)."""
        self.next_poll = min(self.next_poll, now)

    def poll_soon(self, now: float, gap: float, again: float) -> None:
        """A poll now, or `gap` after the last one brought forward this way, and one more `again` seconds
        later (a holder let go of a GPU: NVML may list its context a while after its close)."""
        at = max(now, self.last_early_poll + gap)
        if at < self.next_poll:
            self.next_poll = self.last_early_poll = at
        self.again_at = now + again

    def polling(self, now: float, full: bool, incremental: bool) -> bool:
        """A poll begins: the next ones set; whether it reads per-process utilization."""
        d = self.defaults
        sample = now >= self.next_utilization
        if sample:
            self.next_utilization = now + min(UTILIZATION_SECONDS, UTILIZATION_POLLS * d.interval_seconds)
        self.next_poll = now + d.interval_seconds
        self.full_requested = False
        if self.again_at is not None and now >= self.again_at:
            self.again_at = None
        if full or not incremental:
            self.next_full = now + d.full_scan_seconds
        return sample

    def poll_scan(self, now: float, full: bool, covered: bool, unexplained: Callable[[], bool]) -> str:
        """The scan of this poll: "full"; "changed" (every process's fd signature compared) when due, where
        an open of some GPU's node would not wake us (not `covered`), or when NVML shows use the holders do
        not explain; else "new"."""
        if full:
            mode = "full"
        elif now >= self.next_signatures or not covered or unexplained():
            mode = "changed"
        else:
            return "new"
        self.next_signatures = now + max(self.defaults.interval_seconds, SIGNATURE_SECONDS)
        return mode

    def take_owed(self) -> Optional[str]:
        mode, self.owed = self.owed, None
        return mode

    def take_deferred(self, now: float) -> None:
        """The deferred full scan runs now."""
        self.deferred_full = None
        self.last_event_full = now

    def defer_full(self, now: float, every: bool = False) -> None:
        """A full scan of fd tables as soon as the rate limit allows (`every`: of every process)."""
        if every:
            self.every_next = True
        if self.deferred_full is None:
            self.deferred_full = max(now, self.last_event_full + EVENT_FULL_SCAN_GAP)

    def event_full_now(self, now: float) -> bool:
        """Whether an open's full scan may run now (taken if so), or must be deferred."""
        if now - self.last_event_full < EVENT_FULL_SCAN_GAP:
            return False
        self.last_event_full = now
        return True
