"""The queue's unix socket, served by a thread of its own, never by the daemon's loop: a slow, silent or
hostile client can never delay a yield, nor (non-blocking, one selector) another user's submit.

Each connection: the kernel's peer credentials (SO_PEERCRED) when it is accepted, one request frame within
CLIENT_SECONDS of connecting, one answer, closed. Garbage, an oversized frame or silence gets a one-line
error answer (when the client still listens) and the connection is closed. The socket is 0666 in a 0755
directory: who may do what is decided per request from the peer's uid (requests.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import selectors
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

from gpu_mon.queue.protocol import MAX_ANSWER, Encoded, FrameReader, ProtocolError, encode
from gpu_mon.queue.requests import Peer, Requests

log = logging.getLogger("gpu_mon")

CLIENT_SECONDS = 3.0  # to send its request; as long again to read the answer
MAX_CONNECTIONS = 4000
_CRED = struct.Struct("3i")


class ServerError(Exception):
    """The socket cannot be made; str() is one line."""


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    deadline: float
    reader: FrameReader = field(default_factory=FrameReader)
    out: bytes = b""
    sent: int = 0
    answered: bool = False


class Server:
    """Listens on `path` in a thread; `stop` ends it and removes the socket."""

    def __init__(self, path: str, requests: Requests):
        self.path, self.requests = path, requests
        self.sel = selectors.DefaultSelector()
        self.conns: Dict[int, _Conn] = {}
        self.listener: Optional[socket.socket] = None
        self.thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = False
        self.max_conns = _max_connections()

    def start(self) -> None:
        """Make the socket and start serving; ServerError when the socket cannot be made."""
        directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            st = os.lstat(self.path) if os.path.lexists(self.path) else None
            if st is not None and not stat.S_ISSOCK(st.st_mode):
                raise ServerError(f"{self.path} exists and is not a socket: not replacing it")
            if st is not None:
                os.unlink(self.path)  # a socket left by a daemon that was killed
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            # Made under another name and renamed into place: a client never finds it before it listens.
            fresh = f"{self.path}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(fresh)
            listener.bind(fresh)
            os.chmod(fresh, 0o666)
            listener.listen(1024)
            os.rename(fresh, self.path)
        except OSError as err:
            raise ServerError(f"cannot listen on {self.path}: {err.strerror or err}") from None
        listener.setblocking(False)
        self.listener = listener
        self.sel.register(listener, selectors.EVENT_READ, "listen")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.thread = threading.Thread(target=self._serve, name="gpu-mon-queue", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop serving, close every connection, remove the socket."""
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        if self.thread is not None:
            self.thread.join(5.0)
        for conn in list(self.conns.values()):
            self._close(conn)
        if self.listener is not None:
            self.listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            self.requests.prepare()  # (in this thread: a long queue never delays the daemon's start)
        except Exception:
            log.exception("queue: internal error preparing the listing")
        while not self._stopping:
            now = time.monotonic()
            deadline = min((c.deadline for c in self.conns.values()), default=now + 60.0)
            for key, mask in self.sel.select(max(0.0, deadline - now)):
                try:
                    self._ready(key.data, mask)
                except Exception:  # a bug answering one client must not end the server
                    log.exception("queue: internal error serving a client")
                    if isinstance(key.data, _Conn):
                        self._close(key.data)
            self._expire(time.monotonic())

    def _ready(self, what: object, mask: int) -> None:
        if what == "listen":
            self._accept()
        elif what == "wake":
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)
        elif isinstance(what, _Conn):
            if mask & selectors.EVENT_READ and not what.answered:
                self._read(what)
            if mask & selectors.EVENT_WRITE:
                self._write(what)

    def _accept(self) -> None:
        assert self.listener is not None
        for _ in range(256):  # a burst; the rest next time round
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("queue: too many open files; a client waits")
                    return
                raise
            sock.setblocking(False)
            pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            conn = _Conn(sock, Peer(pid, uid, gid), time.monotonic() + CLIENT_SECONDS)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)
            if len(self.conns) > self.max_conns:
                self._evict()

    def _evict(self) -> None:
        """Too many clients at once: the user with the most connections loses their oldest waiting one
        (one line), so that many connections of one user never keep another's submit out."""
        per_uid: Dict[int, int] = {}
        for c in self.conns.values():
            per_uid[c.peer.uid] = per_uid.get(c.peer.uid, 0) + 1
        uid = max(per_uid, key=lambda u: per_uid[u])
        waiting = [c for c in self.conns.values() if c.peer.uid == uid and not c.answered]
        if not waiting:
            return
        oldest = min(waiting, key=lambda c: c.deadline)
        with contextlib.suppress(OSError):
            oldest.sock.send(
                encode({"ok": False, "error": "too many connections from you at once", "code": 1})
            )
        self._close(oldest)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        try:
            req = conn.reader.feed(data)
        except ProtocolError as err:
            log.debug("queue: uid %d pid %d: %s", conn.peer.uid, conn.peer.pid, err)
            self._answer(conn, {"ok": False, "error": str(err), "code": 2})
            return
        if req is not None:
            self._answer(conn, self.requests.answer(conn.peer, req))

    def _answer(self, conn: _Conn, answer: Union[dict, Encoded]) -> None:
        try:
            conn.out = encode(answer, MAX_ANSWER)
        except Exception as err:  # (an answer too large to send)
            conn.out = encode({"ok": False, "error": str(err), "code": 1})
        conn.answered = True
        conn.deadline = time.monotonic() + CLIENT_SECONDS
        self.sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            conn.sent += conn.sock.send(memoryview(conn.out)[conn.sent :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.sent >= len(conn.out):
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            if not conn.answered:
                log.debug("queue: uid %d pid %d sent no request in time", conn.peer.uid, conn.peer.pid)
                with contextlib.suppress(OSError):
                    conn.sock.send(encode({"ok": False, "error": "no request in time", "code": 2}))
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()


def _max_connections() -> int:
    """Clients served at once: within the open-files limit, leaving the daemon room for its own files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - 256))
