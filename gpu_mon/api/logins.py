"""Which terminals someone is logged in on: what `status` lists (not the dozens of consoles that exist
with nobody on them).

A terminal counts as logged in when its device is owned by a user other than root (login, sshd and
terminal emulators give the terminal to its user, and take it back at logout), or when the login record
(utmp) lists a live login session on it (root's own logins). Without a utmp file, only ownership tells.
"""

from __future__ import annotations

import os
import struct
from typing import Set

from gpu_mon.api import procfs

UTMP = "/run/utmp"
_RECORD = struct.Struct("<hxxi32s4s32s256shhiii4i20s")  # glibc's struct utmp on 64-bit Linux, 384 bytes
_USER_PROCESS = 7
_MAX_BYTES = 4 << 20


def logged_in_lines(path: str = UTMP, proc: str = procfs.PROC) -> Set[str]:
    """The terminal lines (`pts/3`, `tty1`) with a live login session in utmp; empty when unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES)
    except OSError:
        return set()
    found = set()
    for offset in range(0, len(data) - _RECORD.size + 1, _RECORD.size):
        kind, pid, line = _RECORD.unpack_from(data, offset)[:3]
        name = line.split(b"\0", 1)[0].decode("utf-8", "replace")
        if kind == _USER_PROCESS and name and pid > 0 and os.path.exists(f"{proc}/{pid}"):
            found.add(name)
    return found


def line_of(device: str) -> str:
    """`/dev/pts/3` -> `pts/3`, as utmp names terminals."""
    return device[len("/dev/") :] if device.startswith("/dev/") else device


def logged_in(device: str, owner_uid: int, lines: Set[str]) -> bool:
    """Whether someone is logged in on the terminal: not root's, or root's with a login session."""
    return owner_uid != 0 or line_of(device) in lines
