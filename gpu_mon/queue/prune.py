"""Finished jobs leave the queue's database after `[queue] keep_finished_days` (never sooner than the fair
order's window, which counts their GPU-seconds): checked when the daemon starts, then hourly, and at once
when a reload changes the setting. In a thread of its own, never in the daemon's loop or its yield path;
the store removes them a few hundred per transaction."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from gpu_mon.api import historydb
from gpu_mon.config import QueueSection
from gpu_mon.queue.store import Store

log = logging.getLogger("gpu_mon")

EVERY_SECONDS = 3600.0


def kept_seconds(q: QueueSection) -> Optional[float]:
    """How long a finished job is kept; None: for ever."""
    if q.keep_finished_days <= 0:
        return None
    return max(q.keep_finished_days * 86400.0, q.fair_window_hours * 3600.0)


class Pruner:
    """The thread that removes old finished jobs; `poke` makes it look now, `stop` ends it."""

    def __init__(self, store: Store, section: Callable[[], QueueSection], wall: Callable[[], float]):
        self.store, self.section, self.wall = store, section, wall
        self._wake = threading.Event()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Look now, then every hour."""
        self._thread = threading.Thread(target=self._run, name="gpu-mon-queue-prune", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Look again now (the setting changed)."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread (a transaction under way is finished first)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30.0)

    def _run(self) -> None:
        while not self._stopping:
            self.once()
            self._wake.wait(EVERY_SECONDS)
            self._wake.clear()

    def once(self) -> int:
        """Remove what is old enough now; how many (one log line when any)."""
        q = self.section()
        keep = kept_seconds(q)
        if keep is None or self._stopping:
            return 0
        try:
            removed = self.store.prune(self.wall() - keep)
        except historydb.Error as err:
            log.error("queue: cannot remove old finished jobs from %s: %s", q.database, err)
            return 0
        if removed:
            log.info(
                "queue: %d finished job(s) older than %g day(s) removed from %s",
                removed,
                keep / 86400.0,
                q.database,
            )
        return removed
