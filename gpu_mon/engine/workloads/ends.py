"""A job's end, kept where only root writes and nothing deletes it behind gpu-mon's back: the directory of
the queue's database (/var/lib/gpu_mon; not the runtime directory, which systemd removes when gpu-mon's unit
stops), so that an end that came while gpu-mon was stopped, hung, dying, restarting or being upgraded is
found by the next daemon and recorded (never run again). Two writers, neither of them gpu-mon itself:
- a direct job's leader (leader.py) writes it the moment the job's main process has ended, before it tells
  the daemon: `CODE SIGNAL WALL`, the exit code (128 + signal when killed), the signal (0: it exited), when;
- a job's transient unit (transient.py) writes it from its own ExecStopPost=, run by systemd as root when
  the unit has ended, whether gpu-mon runs or not: `unit KIND STATUS`, systemd's $EXIT_CODE (exited,
  killed, dumped) and $EXIT_STATUS (a number, or a signal's name); when: the file's modification time.
  Its ExecStop= (run only when systemd stops the unit while its main process lives: a shutdown, an admin's
  `systemctl stop`, the guard of unguarded.py) leaves a mark beside it, `….stopped`: such an end is not
  the job's own, and the job goes back to the queue.
One small file per run, `gpu-mon-job-ID-rRESTARTS.end`, made 0600 under a temporary name and renamed into
place, so that it is whole or absent.

Standard library only: the leader imports it, and starts in tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from typing import NamedTuple, Optional

_SIZE = 128
# systemd-run's line as a unit ends (transient.py): the unit's main process's own end
_UNIT_ENDED = r"^Main processes terminated with: code=(\w+)/status=(\w+)$"


_KINDS = {"exited", "killed", "dumped"}


class End(NamedTuple):
    """How one run's main process ended."""

    code: int  # the exit code; 128 + the signal when one killed it
    signal: int  # the signal that killed it (0: it exited)
    wall: float  # when (time.time())


def path(directory: str, job_id: int, restarts: int) -> str:
    """The record of one run of a job."""
    return os.path.join(directory, f"gpu-mon-job-{job_id}-r{restarts}.end")


def write(where: str, end: End) -> None:
    """Write the record (OSError if it cannot be: the caller goes on without it)."""
    tmp = f"{where}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{end.code} {end.signal} {end.wall:.3f}\n".encode("ascii"))
    finally:
        os.close(fd)
    os.rename(tmp, where)


def read(where: str) -> Optional[End]:
    """The record, if there is a whole one that root wrote (a file anyone else made there is not one)."""
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return None
        parts = os.read(fd, _SIZE).decode("ascii").split()
        if parts[:1] == ["unit"]:
            code, sig = _of_systemd(parts[1], parts[2])
            wall = st.st_mtime
        else:
            code, sig, wall = int(parts[0]), int(parts[1]), float(parts[2])
    except (OSError, ValueError, IndexError, KeyError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
    return End(code, sig, wall) if 0 <= code <= 255 and 0 <= sig < 128 else None


def _of_systemd(kind: str, value: str) -> tuple:
    """(code, signal) of systemd's $EXIT_CODE and $EXIT_STATUS (KeyError, ValueError when not one)."""
    if kind not in _KINDS:
        raise KeyError(kind)
    if kind == "exited":
        return int(value), 0
    if value.isdigit():
        return 128 + int(value), int(value)
    sig = int(signal.Signals[value if value.startswith("SIG") else f"SIG{value}"])
    return 128 + sig, sig


def stop_mark(where: str) -> str:
    """The mark a unit's ExecStop= leaves beside its end when systemd stopped it while it ran."""
    return f"{where[: -len('.end')]}.stopped" if where.endswith(".end") else f"{where}.stopped"


def stopped_by_systemd(where: str) -> bool:
    """Whether systemd stopped the run (its mark is there, root's): its end is not the job's own."""
    try:
        st = os.lstat(stop_mark(where))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == 0


def remove(where: str) -> None:
    """The record has been taken (or is stale): gone, with any half-written one and its mark."""
    for name in (where, f"{where}.tmp", stop_mark(where)):
        with contextlib.suppress(OSError):
            os.unlink(name)


def of_status(status: int) -> tuple:
    """(code, signal) of a wait status."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status), os.WTERMSIG(status)
    return (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1), 0


def of_unit(text: str) -> Optional[tuple]:
    """(code, signal) from what `systemd-run --wait` said as its unit ended; None when it said nothing."""
    import re  # (only a unit's leader needs it: the others start without)

    found = re.findall(_UNIT_ENDED, text, re.M)
    if not found:
        return None
    try:
        return _of_systemd(*found[-1])
    except (KeyError, ValueError):
        return None
