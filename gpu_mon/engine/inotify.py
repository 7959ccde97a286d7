"""IN_OPEN (and IN_CLOSE) watches on GPU device nodes, in a few lines of ctypes.

Why not inotify_simple: we need three calls and one event flag; ctypes keeps the dependency list (and the
Debian package's) at nvidia-ml-py, psutil and sdnotify. An open of a watched inode by any path (a hard link
too) wakes the daemon at once; a container's own device node is another inode and is caught by polling.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from typing import Dict, Iterable, List, Optional, Tuple

IN_OPEN = 0x00000020
IN_ATTRIB = 0x00000004
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_IGNORED = 0x00008000
IN_Q_OVERFLOW = 0x00004000
IN_CLOSE_WRITE = 0x00000008
IN_CLOSE_NOWRITE = 0x00000010
IN_CLOSE = IN_CLOSE_WRITE | IN_CLOSE_NOWRITE
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
_SELF = IN_DELETE_SELF | IN_MOVE_SELF
_MAX_READS = 16


class Inotify:
    """A non-blocking inotify fd watching a set of paths for opens (or other `events`)."""

    def __init__(self, events: int = IN_OPEN) -> None:
        self.events = events
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd: int = fd
        self._wd_path: Dict[int, str] = {}
        self._path_wd: Dict[str, int] = {}

    def watch(self, paths: Iterable[str]) -> Dict[str, str]:
        """Watch exactly these paths (adding and removing watches); return {path: error} for failures."""
        wanted = set(paths)
        errors: Dict[str, str] = {}
        for path in list(self._path_wd):
            if path not in wanted:  # (its IN_IGNORED, and what was queued for it, is read as nobody's)
                wd = self._path_wd.pop(path)
                self._wd_path.pop(wd, None)
                self._libc.inotify_rm_watch(self.fd, wd)
        for path in wanted:
            if path in self._path_wd:
                continue
            wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), self.events | _SELF)
            if wd < 0:
                errors[path] = os.strerror(ctypes.get_errno())
                continue
            self._wd_path[wd] = path
            self._path_wd[path] = wd
        return errors

    def read(self) -> Tuple[List[str], bool]:
        """Drain pending events: (paths that were opened, or had another of `events`; whether watches must be
        renewed)."""
        opened: List[str] = []
        renew = False
        for _ in range(_MAX_READS):  # (opens in a loop keep the queue filling: the rest waits for next time)
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                path: Optional[str] = self._wd_path.get(wd)
                if mask & IN_Q_OVERFLOW:
                    renew = True
                    opened.extend(self._path_wd)
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED) and path is not None:
                    renew = True  # the node went away (driver unloaded, sim file replaced): watch it afresh
                    self._path_wd.pop(path, None)
                    self._wd_path.pop(wd, None)
                elif mask & self.events and path is not None:
                    opened.append(path)
        return opened, renew

    def pending(self, seconds: float = 0.0) -> bool:
        """Whether events wait to be read (without reading them), waiting up to `seconds` for one."""
        return self.fd >= 0 and bool(select.select([self.fd], [], [], seconds)[0])

    def close(self) -> None:
        """Close the inotify fd (dropping all watches)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
