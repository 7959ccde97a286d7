"""The event loop's seam: one `selectors` loop over readers (inotify, the signal wakeup fd, pidfds, pipes),
deadlines, and the listeners that hear about each round.

Signal handlers only count the signal and write the wakeup fd (`signal.set_wakeup_fd`); the loop takes the
counts when it wakes. Listeners (state file, systemd notify, later history and metrics) receive a
`RoundReport` after the round has acted: they never steer it, and one that raises is logged once and
skipped, so a broken output can never delay a yield.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import selectors
import signal
from typing import Callable, Dict, Iterable, List, Optional, Protocol, Set, Tuple

from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")


class Listener(Protocol):
    """An output of the daemon. Every method must return quickly and may raise (it is then skipped)."""

    def on_round(self, report: RoundReport) -> None:
        """A round has acted."""

    def on_event(self, event: str) -> None:
        """Life cycle: ready, reloading, stopping, stopped; `alive` on every wake."""

    def deadline(self) -> Optional[float]:
        """The monotonic time by which it wants an `alive` event (a watchdog), or None."""


class Loop:
    """Readers, a wakeup fd for signals and threads, deadlines, listeners."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("wake", ""))
        self.listeners: List[Listener] = []
        self._broken: Set[int] = set()
        self._signals: Dict[int, int] = collections.Counter()

    # ------------------------------------------------------------------ signals

    def catch(self, signals: Iterable[int], ignore: Iterable[int] = ()) -> None:
        """Count these signals (see `take`) and wake the loop for each; ignore the others listed."""

        def handler(signum: int, _frame: object) -> None:
            self._signals[signum] += 1

        for sig in signals:
            signal.signal(sig, handler)
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def take(self, sig: int) -> int:
        """How many times `sig` arrived since the last take."""
        count = self._signals.get(sig, 0)
        if count:
            self._signals[sig] = 0
        return count

    def poke(self) -> None:
        """Wake the loop (safe from another thread)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------------ readers and waiting

    def add_reader(self, fd: int, kind: str, name: str = "") -> None:
        """Wake when `fd` is readable; `wait` returns (kind, name) for it."""
        self.selector.register(fd, selectors.EVENT_READ, (kind, name))

    def remove_reader(self, fd: int) -> None:
        """Stop watching `fd` (no error if it was not watched)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def wait(self, deadlines: Iterable[Optional[float]], now: float) -> List[Tuple[str, str]]:
        """Sleep until a reader is ready or the earliest deadline (the listeners' included) has come."""
        wanted = [d for d in deadlines if d is not None]
        listener = self._listener_deadline()
        if listener is not None:
            wanted.append(listener)
        timeout = max(0.0, min(wanted) - now) if wanted else None
        ready = []
        for key, _mask in self.selector.select(timeout):
            kind, name = key.data
            if kind == "wake":
                _drain(self._wake_r)
            else:
                ready.append((kind, name))
        return ready

    def _listener_deadline(self) -> Optional[float]:
        found = [self._call(listener, "deadline") for listener in self.listeners]
        return min((d for d in found if d is not None), default=None)

    # ------------------------------------------------------------------ listeners

    def publish(self, report: RoundReport) -> None:
        """Tell every listener about a round."""
        for listener in self.listeners:
            self._call(listener, "on_round", report)

    def announce(self, event: str) -> None:
        """Tell every listener about a life-cycle event."""
        for listener in self.listeners:
            self._call(listener, "on_event", event)

    def _call(self, listener: Listener, method: str, *args: object) -> Optional[float]:
        fn: Callable = getattr(listener, method)
        try:
            return fn(*args)
        except Exception:  # an output must never take the loop down
            if id(listener) not in self._broken:
                self._broken.add(id(listener))
                name = type(listener).__name__
                log.exception("%s.%s failed (shown once; the daemon goes on)", name, method)
            return None

    def close(self) -> None:
        """Release the wakeup pipe and the selector."""
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self.selector.close()


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            raise
