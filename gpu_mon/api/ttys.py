"""Terminal users: the owner of each terminal device and how long since someone typed on it.

The kernel stamps a tty's atime when a program reads it (the user's input) and its mtime when a program
writes to it (output), each to 8 s so that keystroke timing does not leak. Only input counts: a training
job printing to a user's terminal is not the user sitting there, so now - atime is how long the terminal
has been idle (as `w` counts it). Devices that vanish while we look are skipped. /dev/tty, /dev/console
and /dev/ptmx (major 5) are not anybody's terminal.
"""

from __future__ import annotations

import glob
import os
import stat
from typing import Iterable, List, Tuple

from gpu_mon.api import procfs
from gpu_mon.api.model import TtyUser

_TTYAUX_MAJOR = 5  # /dev/tty, /dev/console, /dev/ptmx


def scan_ttys(patterns: Iterable[str], now_wall: float) -> Tuple[TtyUser, ...]:
    """Every terminal matched by the globs with its owner and idle seconds (never negative)."""
    seen = set()
    out: List[TtyUser] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if path in seen:
                continue
            seen.add(path)
            try:
                st = os.stat(path)
            except OSError:
                continue  # logged out while we looked
            if stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == _TTYAUX_MAJOR:
                continue
            if not (stat.S_ISCHR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                continue
            out.append(
                TtyUser(
                    device=path,
                    user=procfs.user_name(st.st_uid),
                    uid=st.st_uid,
                    idle_seconds=max(0.0, now_wall - st.st_atime),
                )
            )
    return tuple(out)


def active(ttys: Iterable[TtyUser], idle_seconds: float, whitelist: Iterable[str]) -> Tuple[TtyUser, ...]:
    """Terminals with input within `idle_seconds`, of users not on the whitelist."""
    allowed = set(whitelist)
    return tuple(t for t in ttys if t.idle_seconds < idle_seconds and t.user not in allowed)
