"""Opening files without following planted symlinks, and the root-owned-config check.

Every path is walked one component at a time with O_NOFOLLOW from `/`, so a symlink (or a directory swapped
for one) cannot redirect the open between a check and the use; the checks are made on the opened descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import tempfile
from typing import List, Optional

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFile(Exception):
    """A file that must not be used; str() is a one-line reason naming the path."""


def _why(err: OSError) -> str:
    if err.errno == errno.ELOOP:
        return "is a symlink (refused: it could be redirected)"
    if err.errno == errno.ENOTDIR:
        return "a path component is not a directory (or is a symlink)"
    if err.errno == errno.ENXIO:  # strerror would say "No such device or address"
        return "not a regular file (a socket, a FIFO with no reader, or a device with no driver)"
    return err.strerror or str(err)


def _check_dir(fd: int, path: str, trusted_uid: Optional[int]) -> None:
    if trusted_uid is None:
        return
    st = os.fstat(fd)
    if st.st_uid not in (0, trusted_uid):
        raise UnsafeFile(
            f"{path}: directory is owned by uid {st.st_uid}, not root (refused: whoever owns it could swap "
            "the config); keep the config in a root-owned directory such as /etc"
        )
    # A sticky directory (like /tmp) lets nobody but root rename or remove a root-owned file in it.
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFile(
            f"{path}: directory is writable by group or others (refused); chmod go-w it, or keep the config "
            "in a directory only root can write, such as /etc"
        )


def open_parent(path: str, trusted_uid: Optional[int] = None, resolve: bool = True) -> tuple:
    """Open the directory of `path` component by component; return (dir_fd, final name).

    With `trusted_uid`, every directory must be owned by root (or that uid) and not group/other writable.
    With `resolve`, symlinks in the directory part are resolved once up front (e.g. /var/run -> /run) and the
    walk then refuses any component that has become a symlink since; that is only safe together with the
    ownership checks. Without `resolve`, a symlink anywhere in the directory part is refused.
    """
    given = path
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name:
        raise UnsafeFile(f"{path}: not a file name")
    real_parent = os.path.realpath(parent) if resolve else os.path.normpath(parent)
    fd = os.open("/", _DIR_FLAGS)
    try:
        _check_dir(fd, "/", trusted_uid)
        walked = ""
        for comp in real_parent.split("/"):
            if not comp:
                continue
            walked += "/" + comp
            try:
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except OSError as err:
                if err.errno == errno.ENOENT:  # like cat(1): the file the caller asked for does not exist
                    raise UnsafeFile(f"{given}: {_why(err)}") from None
                raise UnsafeFile(f"{walked}: {_why(err)}") from None
            os.close(fd)
            fd = nfd
            _check_dir(fd, walked, trusted_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _open_in_parent(
    path: str, flags: int, trusted_uid: Optional[int] = None, resolve: bool = True, mode: int = 0o777
) -> int:
    """`path` opened with `flags` in the directory open_parent walks to, never through a symlink."""
    dir_fd, name = open_parent(path, trusted_uid, resolve)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as err:
        raise UnsafeFile(f"{path}: {_why(err)}") from None
    finally:
        os.close(dir_fd)


def read_trusted(path: str, trusted_uid: Optional[int], max_bytes: int) -> bytes:
    """Read a whole regular file; with `trusted_uid`, refuse it unless only root can change it."""
    fd = _open_in_parent(path, os.O_RDONLY | os.O_NONBLOCK, trusted_uid)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path}: not a regular file")
        if trusted_uid is not None:
            if st.st_uid not in (0, trusted_uid):
                raise UnsafeFile(
                    f"{path}: owned by uid {st.st_uid}, not root (refused: it names commands "
                    f"that root will run; chown root {path})"
                )
            if st.st_mode & 0o022:
                raise UnsafeFile(
                    f"{path}: writable by group or others (refused: it names commands that "
                    f"root will run; chmod go-w {path})"
                )
        if st.st_size > max_bytes:
            raise UnsafeFile(f"{path}: too large ({st.st_size} bytes; at most {max_bytes})")
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            if sum(len(c) for c in chunks) > max_bytes:
                raise UnsafeFile(f"{path}: too large (at most {max_bytes} bytes)")
        return b"".join(chunks)
    except OSError as err:
        raise UnsafeFile(f"{path}: {_why(err)}") from None
    finally:
        os.close(fd)


def list_dir(path: str, trusted_uid: Optional[int]) -> List[str]:
    """The names in a directory (a config's drop-ins); with `trusted_uid`, refuse it unless only root can
    change it and its parents. A symlink is refused, as for a config file."""
    fd = _open_in_parent(path, os.O_RDONLY | os.O_DIRECTORY, trusted_uid)
    try:
        _check_dir(fd, path, trusted_uid)
        return os.listdir(fd)
    except OSError as err:
        raise UnsafeFile(f"{path}: {_why(err)}") from None
    finally:
        os.close(fd)


def open_no_links(path: str, flags: int, mode: int = 0o600) -> int:
    """`path` opened with `flags` (O_NOFOLLOW and O_CLOEXEC added) through no symlink in any component: a
    directory of the path swapped for a link, or a link at its end, is refused (UnsafeFile, one line)."""
    return _open_in_parent(path, flags, resolve=False, mode=mode)


def open_as_user(path: str, uid: int, gid: int, groups: List[int]) -> int:
    """`path` opened for reading by a child with the user's ids and groups (from root, for a user's file:
    a link the user made reaches only what the user may read), handed back; a regular file only. OSError
    as the user met it (ENOENT, EACCES, ...); UnsafeFile for anything but a regular file."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        pid = os.fork()
        if pid == 0:  # (the child: nothing but system calls, then _exit)
            _open_for(theirs, path, uid, gid, groups)
        theirs.close()
        try:
            msg, fds, _flags, _addr = socket.recv_fds(mine, 16, 1)
        finally:
            os.waitpid(pid, 0)
    finally:
        mine.close()
        theirs.close()
    if not fds:
        code = int(msg or b"0") or errno.EIO
        raise OSError(code, os.strerror(code), path)
    st = os.fstat(fds[0])
    if not stat.S_ISREG(st.st_mode):
        os.close(fds[0])
        raise UnsafeFile(f"{path}: not a regular file")
    return fds[0]


def _open_for(sock: socket.socket, path: str, uid: int, gid: int, groups: List[int]) -> None:
    """In a forked child: become the user, open `path`, send the descriptor (or the errno) back; exit."""
    try:
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        socket.send_fds(sock, [b"0"], [fd])
    except OSError as err:
        with contextlib.suppress(OSError):
            sock.sendall(str(err.errno or errno.EIO).encode())
    finally:
        os._exit(0)


def open_append(path: str, mode: int = 0o640) -> int:
    """Open (creating) a log file for appending, as root, on behalf of a workload's user.

    No symlink is followed anywhere in the path, and a regular file with more than one link is refused: a
    user who can write to a directory of the path could otherwise point root's appends at any file (a
    symlinked directory, or a hard link to /etc/shadow where protected_hardlinks is off). Returns a blocking
    O_WRONLY|O_APPEND descriptor. Refuses FIFOs, sockets and directories; a character device is accepted
    (log = /dev/null).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
    fd = _open_in_parent(path, flags, resolve=False, mode=mode)
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        os.close(fd)
        raise UnsafeFile(f"{path}: not a regular file or character device")
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        os.close(fd)
        raise UnsafeFile(f"{path}: has {st.st_nlink} hard links (refused: it could be another file)")
    os.set_blocking(fd, True)
    return fd


def replace(path: str, data: bytes, mode: int = 0o644) -> None:
    """Replace `path` atomically: a new file beside it (O_EXCL under a random name, so a planted symlink
    cannot redirect the write), given `mode`, then renamed over it (a rename never follows a symlink)."""
    fd, tmp = tempfile.mkstemp(prefix=".gpu_mon.", suffix=".tmp", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
