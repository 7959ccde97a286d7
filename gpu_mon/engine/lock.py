"""One daemon per state file: an exclusive `flock` on `STATE_FILE.lock`, held for the daemon's lifetime.

The kernel drops a flock when its holder dies, even by SIGKILL, so a stale lock file never blocks a new
daemon. The file is opened without following symlinks and without blocking (a FIFO planted there cannot hang
us); it must be a regular file with one link, owned by us, in a directory that other users cannot write
(unless it is sticky, like /tmp, where only the owner may replace a file). The file is never removed: a
daemon that removed it could let two later ones lock two different files.

The file is 0600: a user who could open it (even read-only) could take the flock and keep every daemon from
starting, or the queue from opening. One that any user may have opened (an earlier gpu-mon made it 0644;
an open descriptor outlives a chmod) is replaced by a new 0600 file under its lock, or, when a process of
another user holds that lock, at once. Users who cannot open the file learn who holds it from /proc/locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from typing import Optional, Tuple

_MODE = 0o600  # root's (or the user's own daemon's) alone
_LOCKS = "/proc/locks"


class LockError(Exception):
    """The lock cannot be had; str() is one line."""


class PlaceError(LockError):
    """The lock's directory cannot be created, or the lock cannot be opened in it; `denied`: for lack of
    permission (another user's state file), not because the place cannot exist."""

    def __init__(self, message: str, denied: bool):
        super().__init__(message)
        self.denied = denied


def _denied(err: OSError) -> bool:
    return err.errno in (errno.EACCES, errno.EPERM)


def lock_path(state_file: str) -> str:
    """Where the lock of the daemon that writes `state_file` lives."""
    return state_file + ".lock"


def _check_directory(directory: str) -> None:
    st = os.stat(directory)
    if st.st_uid != os.geteuid() and st.st_uid != 0:
        raise LockError(
            f"{directory}: owned by uid {st.st_uid}; put state_file in a directory owned by root or by "
            "the user gpu-mon runs as (the default /run/gpu_mon is)"
        )
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise LockError(
            f"{directory}: every user may replace files in it; put state_file in a directory only root "
            "can write (the default /run/gpu_mon is)"
        )


def _open(path: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, _MODE)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise LockError(f"{path}: is a symbolic link; remove it (gpu-mon makes its own)") from None
        raise PlaceError(f"{path}: {err.strerror}", _denied(err)) from None
    st = os.fstat(fd)
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not to us"
    elif st.st_nlink != 1:
        problem = "has other hard links"
    if problem:
        os.close(fd)
        if st.st_uid != os.geteuid() and os.geteuid() != 0:  # not ours to remove
            raise PlaceError(f"{path}: belongs to uid {st.st_uid}", True)
        raise LockError(f"{path}: {problem}; remove it (gpu-mon makes its own)")
    if stat.S_IMODE(st.st_mode) & ~_MODE:
        return _replace(fd, path)
    return fd


def _replace(old: int, path: str) -> int:
    """The lock file is ours but others may open it: a new 0600 file, locked, takes its name. Under the old
    one's lock (a daemon waiting on it then finds the name moved: `acquire` locks what the path names), or
    at once where a process of another user holds that lock (no daemon of ours: a user's, to keep us out)."""
    if not _try_flock(old, 1.0):
        pid = _locked_by(os.fstat(old))
        if pid is None or _euid_of(pid) in (None, os.geteuid()):
            os.close(old)
            who = f"pid {pid}" if pid else "pid unknown"
            raise LockError(f"another gpu-mon daemon is running ({who}; lock {path})")
    directory = os.path.dirname(path) or "."
    fresh = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}")
    try:
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _MODE)
    except OSError as err:
        os.close(old)
        raise PlaceError(f"{fresh}: {err.strerror}", _denied(err)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (new: nobody else has it)
        os.rename(fresh, path)
    except OSError as err:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(fresh)
        raise PlaceError(f"{path}: {err.strerror}", _denied(err)) from None
    finally:
        os.close(old)
    return fd


class DaemonLock:
    """The held lock; keep the object alive as long as the daemon runs."""

    def __init__(self, state_file: str):
        self.path = lock_path(state_file)
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock or raise LockError naming the daemon that has it."""
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            _check_directory(directory)
        except OSError as err:
            raise PlaceError(f"{err.filename or directory}: {err.strerror}", _denied(err)) from None
        for _ in range(3):  # the file may be replaced between open and flock: lock what the path names
            fd = _open(self.path)
            _take(fd, self.path)
            if _same_file(fd, self.path):
                self.fd = fd
                mine = f"{os.getpid()}\n".encode()
                os.pwrite(fd, mine, 0)  # then cut what a longer old pid left: never an empty file
                os.ftruncate(fd, len(mine))
                return
            os.close(fd)
        raise LockError(f"{self.path}: keeps being replaced while we lock it")

    def release(self) -> None:
        """Drop the lock (the file stays)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None


def _try_flock(fd: int, wait_seconds: float) -> bool:
    """LOCK_EX on fd, tried for `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _take(fd: int, path: str, wait_seconds: float = 1.0) -> None:
    """LOCK_EX on fd, or close it and raise LockError naming the daemon that holds the lock.

    A daemon holds it for as long as it runs; `holder()` (what `gpu-mon status` asks) holds a shared lock
    for an instant: so try again for `wait_seconds` before giving up (a daemon started while someone ran
    `status` refused to start). Then the pid the holder wrote names it, if it is alive."""
    if _try_flock(fd, wait_seconds):
        return
    pid = _read_pid(fd) or _locked_by(os.fstat(fd))
    os.close(fd)
    who = f"pid {pid}" if pid is not None and pid > 0 and os.path.isdir(f"/proc/{pid}") else "pid unknown"
    raise LockError(f"another gpu-mon daemon is running ({who}; lock {path})")


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(state_file: str) -> Optional[int]:
    """Pid of the live daemon that holds the lock of `state_file` (read-only probe), or None; -1: held, by
    a pid unknown. A user who may not open the lock (0600) is told by /proc/locks."""
    path = lock_path(state_file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except PermissionError:
        return _holder_unopened(path)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or _locked_by(os.fstat(fd)) or -1
        except OSError:
            return None
        return None  # we got it: nobody holds it
    finally:
        os.close(fd)


def _holder_unopened(path: str) -> Optional[int]:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return _locked_by(st) if stat.S_ISREG(st.st_mode) else None


def _locked_by(st: os.stat_result) -> Optional[int]:
    """The pid that holds an exclusive flock on the file (as /proc/locks says; -1: held by a pid this PID
    namespace cannot see), or None."""
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open(_LOCKS, "rb") as f:  # (bytes: no codec to import, whoever we run as)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        held = _parse_lock_line(line)
        if held is not None and held[1] == want:
            return held[0] if held[0] > 0 else -1
    return None


def _parse_lock_line(line: str) -> Optional[Tuple[int, Tuple[int, int, int]]]:
    """`1: FLOCK  ADVISORY  WRITE 8597 fe:00:2146549 0 EOF` -> (8597, (0xfe, 0, 2146549)); a waiter's
    line (`->`), a shared or another kind of lock: None."""
    parts = line.split()
    if len(parts) < 6 or parts[1:4] != ["FLOCK", "ADVISORY", "WRITE"]:
        return None
    try:
        major, minor, ino = parts[5].split(":")
        return int(parts[4]), (int(major, 16), int(minor, 16), int(ino))
    except ValueError:
        return None


def _euid_of(pid: int) -> Optional[int]:
    """The effective uid of a process (its status: /proc/PID itself is root's when it is not dumpable)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        return None
    return None
