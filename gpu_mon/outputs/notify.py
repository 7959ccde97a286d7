"""systemd notify protocol (READY, STATUS, WATCHDOG, RELOADING, STOPPING). The only importer of sdnotify.

sdnotify encodes messages as latin-1 and silently drops any message it cannot encode, so a user or GPU name
outside latin-1 would lose the whole STATUS line. systemd reads the datagram as UTF-8, so we hand sdnotify
our UTF-8 bytes spelled as latin-1 characters: it encodes them back to exactly those bytes. Control
characters are escaped first so that a name can never add a line (a new assignment) to the datagram.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from gpu_mon.api.text import sanitize
from gpu_mon.policy import words
from gpu_mon.policy.report import RoundReport

_MAX_STATUS = 1024


def _wire(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("latin-1")


def watchdog_interval(env: Optional[dict] = None) -> Optional[float]:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is asked for."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None


class Notifier:
    """Talks to systemd when NOTIFY_SOCKET is set; otherwise every call is a no-op."""

    def __init__(self, env: Optional[dict] = None):
        env = os.environ if env is None else env
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._notifier = None
        self._status: Optional[str] = None
        self.watchdog_every = watchdog_interval(env) if self.enabled else None
        self._next_watchdog = 0.0
        if self.enabled:
            import sdnotify

            self._notifier = sdnotify.SystemdNotifier()

    def send(self, *assignments: str) -> None:
        """Send one datagram of `KEY=value` lines."""
        if self._notifier is not None:
            self._notifier.notify(_wire("\n".join(assignments)))

    def ready(self) -> None:
        """READY=1: the first complete look at the host is done."""
        self.send("READY=1")

    def status(self, text: str) -> None:
        """STATUS=... when it changed since the last one."""
        line = sanitize(text, limit=_MAX_STATUS)
        if line != self._status:
            self._status = line
            self.send(f"STATUS={line}")

    def watchdog(self) -> None:
        """WATCHDOG=1: the event loop is alive."""
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        """RELOADING=1 with MONOTONIC_USEC (systemd >= 253 wants the timestamp)."""
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        """STOPPING=1: shutting down."""
        self.send("STOPPING=1")

    # ------------------------------------------------------------------ as a round listener

    def on_round(self, report: RoundReport) -> None:
        """STATUS= the round's one-line summary."""
        if self.enabled:
            self.status(words.status_line(report))

    def on_event(self, event: str) -> None:
        """READY, RELOADING, STOPPING; WATCHDOG on `alive` when one is due."""
        if event == "ready":
            self.ready()
        elif event == "reloading":
            self.reloading()
        elif event == "stopping":
            self.stopping()
        elif event == "alive" and self.watchdog_every:
            now = time.monotonic()
            if now >= self._next_watchdog:
                self.watchdog()
                self._next_watchdog = now + self.watchdog_every

    def deadline(self) -> Optional[float]:
        """When the next WATCHDOG=1 is due (the loop wakes for it)."""
        return self._next_watchdog if self.watchdog_every else None
