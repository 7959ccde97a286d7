"""How the stressor hears a stop (SIGTERM, SIGINT) in each phase, and how it ends after one.

Until it allocates, a stop is left to the signal's default action: the kernel ends the process at once, and
there is nothing to release (a CUDA context, if one was made, goes with the process). A Python handler could
not do that: it runs only between bytecodes, and importing torch spends whole stretches in C (loading
libtorch and its initialisers: up to 240 ms at a time with torch's CPU build on a 2-core machine, over a
second with a CUDA build), so a stop sent then waited for the import. From the first allocation on, the
handler only records the signal and wakes `wait`; the stressor stops allocating or computing, releases, prints
its exit line, and then ends by the same signal with its default action, so that every stop ends the process
the same way, whatever the phase: killed by that signal (status 143 for SIGTERM, 130 for SIGINT in a shell).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from typing import Any, List, Optional, Tuple

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """SIGTERM and SIGINT: their default action until `catch`, then a flag and a wakeup pipe."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._saved: List[Tuple[int, Any]] = []
        self._saved_fd: Optional[int] = None
        self._main = True

    def default(self) -> StopSignal:
        """Leave a stop to the kernel: SIGTERM and SIGINT at their default action (even if ignored)."""
        try:
            for signum in STOP_SIGNALS:
                self._saved.append((signum, signal.signal(signum, signal.SIG_DFL)))
        except ValueError:  # not the main thread: no signals reach us; --duration still ends the run
            self._main = False
        return self

    def catch(self) -> None:
        """From now on a stop only sets the flag and wakes `wait` (the stressor holds memory to release)."""
        if not self._main:
            return
        self._saved_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for signum, _ in self._saved:
            signal.signal(signum, self._handle)

    def restore(self) -> None:
        """Put back the handlers and wakeup fd there were before `default`, and close the pipe."""
        for signum, handler in self._saved:
            signal.signal(signum, handler)
        if self._saved_fd is not None:
            signal.set_wakeup_fd(self._saved_fd)
        os.close(self._rfd)
        os.close(self._wfd)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def reason(self) -> Optional[str]:
        """The name of the stop signal received, or None."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`; a signal's byte on the wakeup pipe ends the sleep at once."""
        if self.signum is None and seconds > 0:
            select.select([self._rfd], [], [], seconds)
        try:
            while os.read(self._rfd, 512):
                pass
        except BlockingIOError:
            pass


def status_after(signum: int) -> int:
    """The status a shell reports for a process killed by `signum` (what the exit line says)."""
    return 128 + signum


def die_by(signum: int) -> int:
    """End this process by `signum`'s default action, as an early stop does; returns only if it survives."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    try:
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    except ValueError:  # not the main thread
        return status_after(signum)
    os.kill(os.getpid(), signum)
    return status_after(signum)
