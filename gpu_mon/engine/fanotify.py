"""Who opened a GPU node, as the kernel says it: fanotify FAN_OPEN marks on the nodes, in a few lines of
ctypes (the reasons of inotify.py hold here too).

inotify says that a node was opened, not by whom; fanotify's events carry the opener's pid. They are hints
only: the opener search reads those processes first (see HolderScanner.changed), and decides on what it
reads there, as for any other process. The group reports file handles (FAN_REPORT_FID), not descriptors,
so the kernel opens nothing on our behalf (a descriptor per event would mean opening a GPU's node through
its driver). It needs CAP_SYS_ADMIN (root) and Linux 5.1; a node on a filesystem without file handles
cannot be marked. Without it the search does as before: the likeliest openers first.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Dict, Iterable, Tuple

FAN_CLOEXEC = 0x00000001
FAN_NONBLOCK = 0x00000002
FAN_CLASS_NOTIF = 0x00000000
FAN_REPORT_FID = 0x00000200
FAN_MARK_ADD = 0x00000001
FAN_OPEN = 0x00000020
FAN_Q_OVERFLOW = 0x00004000
AT_FDCWD = -100
_META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_MAX_PIDS = 64  # pids kept between two takes (a process opening in a loop must not grow this)
_MAX_READS = 16  # reads of the queue per call (~2500 events)


class Fanotify:
    """A non-blocking fanotify group marking a set of paths for opens; `read` collects the openers' pids."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
        self._libc.fanotify_mark.argtypes = [
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_char_p,
        ]
        self.fd = self._init()
        self.pids: Dict[int, None] = {}  # openers since the last take, the latest last

    def _init(self) -> int:
        flags = FAN_CLOEXEC | FAN_NONBLOCK | FAN_CLASS_NOTIF | FAN_REPORT_FID
        fd = self._libc.fanotify_init(flags, os.O_RDONLY | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"fanotify_init: {os.strerror(err)}")
        return fd

    def watch(self, paths: Iterable[str]) -> Dict[str, str]:
        """Mark exactly these paths (a new group: marks are few and change rarely); {path: error}."""
        fd = self._init()
        os.close(self.fd)
        self.fd = fd
        errors = {}
        for path in paths:
            if self._libc.fanotify_mark(fd, FAN_MARK_ADD, FAN_OPEN, AT_FDCWD, os.fsencode(path)) < 0:
                errors[path] = os.strerror(ctypes.get_errno())
        return errors

    def read(self) -> None:
        """Collect the pids of the opens the kernel reported (0, a process outside our pid namespace, left
        out). At most _MAX_READS reads: a flood of opens must not hold the loop (the rest waits)."""
        for _ in range(_MAX_READS):
            try:
                data = os.read(self.fd, 8192)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                return
            offset = 0
            while offset + _META.size <= len(data):
                length, _vers, _res, _meta, mask, fd, pid = _META.unpack_from(data, offset)
                if length < _META.size:
                    return  # (a malformed event: stop reading this buffer)
                offset += length
                if fd >= 0:
                    os.close(fd)  # (none in FID mode; closed all the same)
                if mask & FAN_OPEN and pid > 0:
                    self.pids.pop(pid, None)
                    self.pids[pid] = None
                    if len(self.pids) > _MAX_PIDS:
                        del self.pids[next(iter(self.pids))]

    def take(self) -> Tuple[int, ...]:
        """The openers reported since the last take, the latest first."""
        pids, self.pids = tuple(reversed(self.pids)), {}
        return pids

    def close(self) -> None:
        """Close the group (dropping its marks)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
