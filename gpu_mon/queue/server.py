"""The queue's unix socket, served by a thread of its own, never by the daemon's loop: a slow, silent or
hostile client can never delay a yield, nor (non-blocking, one selector) another user's submit.

Each connection: the kernel's peer credentials (SO_PEERCRED) when it is accepted, one request frame within
CLIENT_SECONDS of connecting, one answer, closed. Garbage, an oversized frame or silence gets a one-line
error answer (when the client still listens) and the connection is closed. The socket is 0666 in a 0755
directory: who may do what is decided per request from the peer's uid (requests.py).

What one user can make the daemon hold is bounded (one line refuses the rest; root is not counted against
MAX_USER_CONNECTIONS): at most MAX_USER_CONNECTIONS connections at once, REQUEST_BYTES_PER_USER bytes of
requests not yet complete (REQUEST_BYTES for all users: past it, the user holding the most loses their
largest), and ANSWER_BYTES_PER_USER bytes of answers made and not yet read (ANSWER_BYTES for all). A long
answer is sent in pages (protocol.Pages), each made when the last one is read and only while the user's
and everyone's answer bytes are within those limits: otherwise the connection waits its turn (at most
PARK_SECONDS), and a client must read each page within CLIENT_SECONDS.

What one user's requests can take of this thread's time is bounded too (budget.Share): SHARE of a core
over time, SHARE_BURST seconds at once (root's are not counted). A user past it has their next request,
or their answer's next page, wait their turn, in the order they came (the rest of the thread's time goes
to the others at once); the answer then says it was slowed and why ("slowed", one line that `gpu-mon`
prints), and a request that waits over TURN_SECONDS is refused in one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
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
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Union

from gpu_mon.queue.budget import Budget, Share
from gpu_mon.queue.checking import Checks
from gpu_mon.queue.protocol import (
    MAX_ANSWER,
    PAGE_BYTES,
    Encoded,
    FrameReader,
    Pages,
    ProtocolError,
    encode,
)
from gpu_mon.queue.requests import Peer, Requests

log = logging.getLogger("gpu_mon")

CLIENT_SECONDS = 3.0  # to send its request; as long again to read the answer (each page of it)
PARK_SECONDS = 30.0  # an answer waits at most this long for its turn to be made
CHECK_SECONDS = 60.0  # a submit waits at most this long for its check (its own is 3 s; others' before it)
MAX_CONNECTIONS = 4000
MAX_USER_CONNECTIONS = 32  # one user's connections at once (root's are not counted)
REQUEST_BYTES_PER_USER = 16 << 20  # received bytes of one user's requests not yet complete
REQUEST_BYTES = 64 << 20  # ... of every user's
ANSWER_BYTES_PER_USER = 16 << 20  # bytes of answers to one user made and not yet handed to the kernel
ANSWER_BYTES = 64 << 20  # ... to every user
SHARE = 0.1  # of a core: the server thread's time one user's requests may take over time
SHARE_BURST = 1.0  # seconds of it one user's requests may take at once
TURN_SECONDS = 20.0  # a request waits at most this long for its user's turn (a client waits 30 s)
_CRED = struct.Struct("3i")
_MIB = 1 << 20
_TOO_MANY = "too many connections from you at once"


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
    rest: Optional[Iterator[bytes]] = None  # the pages of the answer still to be made
    parked: bool = False  # waiting for answer bytes to be given back before its next page is made
    held_in: int = 0  # bytes of its request counted in Server.requests_held
    held_out: int = 0  # bytes of its answer counted in Server.answers_held
    request: Optional[dict] = None  # a submit waiting for its check as its user (checking.py)
    resting: bool = False  # waiting for its user's turn (Share): its request (`pending`) or its next page
    pending: Optional[dict] = None
    rested_at: float = 0.0
    has_turn: bool = False  # its turn has come: it goes on, though later ones of its user wait
    waited: float = 0.0  # seconds it waited for turns, said in the next frame it is sent ("slowed")


class Server:
    """Listens on `path` in a thread; `stop` ends it and removes the socket."""

    def __init__(self, path: str, requests: Requests):
        self.path, self.requests = path, requests
        self.sel = selectors.DefaultSelector()
        self.conns: Dict[int, _Conn] = {}
        self.listener: Optional[socket.socket] = None
        self.thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._stopping = False
        self.max_conns = _max_connections()
        self.per_uid: Dict[int, int] = {}  # connections of each user now
        self.requests_held = Budget(REQUEST_BYTES_PER_USER, REQUEST_BYTES)
        self.answers_held = Budget(ANSWER_BYTES_PER_USER, ANSWER_BYTES)
        self.parked: List[_Conn] = []  # in the order they began to wait
        self.share = Share(SHARE, SHARE_BURST)
        self.resting: List[_Conn] = []  # waiting for their user's turn, in the order they began to
        self.slowed_said: Dict[int, float] = {}  # uid -> when the log last said its requests wait turns
        self.checks: Checks[_Conn] = Checks(self._poke)

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
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        try:
            self.requests.prepare()  # (in this thread: a long queue never delays the daemon's start)
        except Exception:
            log.exception("queue: internal error preparing the listing")
        while not self._stopping:
            now = time.monotonic()
            deadline = min((c.deadline for c in self.conns.values()), default=now + 60.0)
            deadline = min(deadline, self._next_turn(now))
            for key, mask in self.sel.select(max(0.0, deadline - now)):
                try:
                    self._ready(key.data, mask)
                except Exception:  # a bug answering one client must not end the server
                    log.exception("queue: internal error serving a client")
                    if isinstance(key.data, _Conn):
                        self._close(key.data)
            self._turns(time.monotonic())
            self._expire(time.monotonic())

    def _ready(self, what: object, mask: int) -> None:
        if what == "listen":
            self._accept()
        elif what == "wake":
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)
            for conn, refusal in self.checks.done():
                self._charged(conn, partial(self._checked, conn, refusal))
        elif isinstance(what, _Conn) and not what.parked and not what.resting and self._open(what):
            self._charged(what, partial(self._serve_conn, what, mask))

    def _serve_conn(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ and not conn.answered:
            self._read(conn)
        if mask & selectors.EVENT_WRITE and not conn.resting and self._open(conn):
            self._write(conn)

    def _open(self, conn: _Conn) -> bool:
        """Whether the connection is still served (not closed)."""
        return self.conns.get(conn.sock.fileno()) is conn

    def _charged(self, conn: _Conn, work: Callable[[], None]) -> None:
        """Do `work` for the connection: the thread's time it takes is its user's (root's is not counted)."""
        started = time.thread_time()
        try:
            work()
        finally:
            if conn.peer.uid != 0:
                self.share.spend(conn.peer.uid, time.thread_time() - started, time.monotonic())

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
            if uid != 0 and self.per_uid.get(uid, 0) >= MAX_USER_CONNECTIONS:
                with contextlib.suppress(OSError):
                    sock.send(_refusal(_TOO_MANY + f" (at most {MAX_USER_CONNECTIONS})"))
                sock.close()
                continue
            conn = _Conn(sock, Peer(pid, uid, gid), time.monotonic() + CLIENT_SECONDS)
            self.conns[sock.fileno()] = conn
            self.per_uid[uid] = self.per_uid.get(uid, 0) + 1
            self.sel.register(sock, selectors.EVENT_READ, conn)
            if len(self.conns) > self.max_conns:
                self._evict()

    def _evict(self) -> None:
        """Too many clients at once: the user with the most connections loses their oldest waiting one
        (one line), so that many connections of one user never keep another's submit out."""
        uid = max(self.per_uid, key=lambda u: self.per_uid[u])
        waiting = [c for c in self.conns.values() if c.peer.uid == uid and not c.answered]
        if waiting:
            self._refuse(min(waiting, key=lambda c: c.deadline), _TOO_MANY)

    def _refuse(self, conn: _Conn, why: str) -> None:
        """One line to the client (if it listens), and the connection closed."""
        with contextlib.suppress(OSError):
            conn.sock.send(_refusal(why))
        self._close(conn)

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
        size = len(conn.reader.buf) + len(data)
        try:
            req = conn.reader.feed(data)
        except ProtocolError as err:
            log.debug("queue: uid %d pid %d: %s", conn.peer.uid, conn.peer.pid, err)
            self._answer(conn, {"ok": False, "error": str(err), "code": 2})
            return
        self._hold_request(conn, len(conn.reader.buf) if req is None else 0)
        if req is None or conn.sock.fileno() not in self.conns:
            return
        if not self._rest(conn, req, size - len(conn.reader.buf)):
            self._dispatch(conn, req)

    def _dispatch(self, conn: _Conn, req: dict) -> None:
        """A whole request, its user's turn come: answered, or (a submit) checked first."""
        if req.get("op") == "submit" and req.get("checked_as_user") is not True:
            self._check(conn, req)
            return
        if req.get("op") == "submit":  # `gpu-mon submit` checked it as the user: the answer at once
            self._answer(conn, self.requests.answer(conn.peer, req, checked=True))
            return
        self._answer(conn, self.requests.answer(conn.peer, req))

    def _check(self, conn: _Conn, req: dict) -> None:
        """A submit: its check as its user runs in a thread of its own; the connection waits for it."""
        self.sel.unregister(conn.sock)
        conn.request, conn.deadline = req, time.monotonic() + CHECK_SECONDS
        self.checks.add(conn.peer.uid, conn, partial(self.requests.check_submit, conn.peer, req))

    def _checked(self, conn: _Conn, refusal: Optional[dict]) -> None:
        """Its check has ended: the refusal, or the submit itself (here, in the server's thread)."""
        req, conn.request = conn.request, None
        if req is None or self.conns.get(conn.sock.fileno()) is not conn:
            return  # (closed meanwhile: nothing is queued)
        self.sel.register(conn.sock, selectors.EVENT_READ, conn)
        if _left(conn.sock):
            self._close(conn)  # (the client is gone: nothing is queued, as it was told nothing)
            return
        self._answer(conn, refusal or self.requests.answer(conn.peer, req, checked=True))

    def _poke(self) -> None:
        """Wake the server thread (from a check's thread): never once the pipe is closed (its number may
        be another file's by then)."""
        with self._wake_lock, contextlib.suppress(OSError):
            if self._wake_w >= 0:
                os.write(self._wake_w, b"\0")

    def _hold_request(self, conn: _Conn, size: int) -> None:
        """Count the connection's unfinished request as `size` bytes; past a limit, refuse (one line)
        this one (its user's limit) or the largest of the user who holds the most (everyone's)."""
        uid, held = conn.peer.uid, self.requests_held
        held.give(uid, conn.held_in)
        held.take(uid, size)
        conn.held_in = size
        if held.of(uid) > held.per_user:
            mib = held.per_user // _MIB
            self._refuse(conn, f"too many unfinished requests from you at once (at most {mib} MiB in all)")
        while held.sum > held.total:
            biggest = held.biggest()
            mine = [c for c in self.conns.values() if c.peer.uid == biggest and c.held_in]
            if not mine:
                break
            victim = max(mine, key=lambda c: c.held_in)
            why = f"too many unfinished requests at once ({held.total // _MIB} MiB; yours are the most)"
            self._refuse(victim, why)

    def _answer(self, conn: _Conn, answer: Union[dict, Encoded, Pages]) -> None:
        self._hold_request(conn, 0)
        conn.answered = True
        conn.deadline = time.monotonic() + CLIENT_SECONDS
        self.sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        if isinstance(answer, Pages):
            conn.rest = answer.bodies
        else:
            self._set_out(conn, _frame(self._noted(conn, answer)))
        self._write(conn)

    # ------------------------------------------------------------------ turns (Share)

    def _rest(self, conn: _Conn, req: Optional[dict] = None, size: int = 0) -> bool:
        """Whether the connection must wait for its user's turn (its user owes the thread time, or an
        earlier one of theirs waits): then it waits, with its request (`req`, counted as `size` bytes of
        requests held) or for its next page."""
        uid, now = conn.peer.uid, time.monotonic()
        if uid == 0 or conn.has_turn:
            conn.has_turn = False
            return False
        if self.share.turn(uid, now) <= now and not any(c.peer.uid == uid for c in self.resting):
            return False
        self._hold_request(conn, size)
        if not self._open(conn):
            return True  # (refused: the user's waiting requests are too many bytes)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.resting, conn.pending, conn.rested_at = True, req, now
        conn.deadline = now + (TURN_SECONDS if req is not None else PARK_SECONDS)
        self.resting.append(conn)
        self._say_slowed(uid, now)
        return True

    def _next_turn(self, now: float) -> float:
        """When the first waiting connection's user has their turn again."""
        return min((self.share.turn(c.peer.uid, now) for c in self.resting), default=now + 60.0)

    def _turns(self, now: float) -> None:
        """Each user whose turn has come: their first waiting connection goes on (the next one waits for
        the turn after: what this one takes is counted first)."""
        passed = set()
        for conn in list(self.resting):
            uid = conn.peer.uid
            if uid in passed:
                continue
            passed.add(uid)
            if self.share.turn(uid, now) <= now:
                self._charged(conn, partial(self._resume, conn, now))

    def _resume(self, conn: _Conn, now: float) -> None:
        self.resting.remove(conn)
        conn.resting, conn.has_turn, conn.waited = False, True, conn.waited + now - conn.rested_at
        conn.deadline = now + CLIENT_SECONDS
        req, conn.pending = conn.pending, None
        self._hold_request(conn, 0)
        self.sel.register(conn.sock, selectors.EVENT_READ if req is not None else selectors.EVENT_WRITE, conn)
        if req is None:
            self._write(conn)
        elif _left(conn.sock):
            self._close(conn)  # (the client is gone: nothing is done, as it would be told nothing)
        else:
            self._dispatch(conn, req)

    def _noted(self, conn: _Conn, answer: Union[dict, Encoded]) -> Union[dict, Encoded]:
        """The answer, with why it was late ("slowed") when the connection waited for turns since its
        last frame."""
        if not conn.waited:
            return answer
        note = (
            f"answered {conn.waited:.1f} s late: your requests have taken their share of the queue's time "
            f"({SHARE:.0%} of a core; root's are not counted)"
        )
        conn.waited = 0.0
        if isinstance(answer, dict):
            return {**answer, "slowed": note}
        return Encoded(answer.body[:-1] + b',"slowed":' + json.dumps(note).encode() + b"}")

    def _say_slowed(self, uid: int, now: float) -> None:
        """One log line a minute at most for a user whose requests wait their turns."""
        if now - self.slowed_said.get(uid, -60.0) < 60.0:
            return
        if len(self.slowed_said) > 1000:
            self.slowed_said = {u: t for u, t in self.slowed_said.items() if now - t < 60.0}
        self.slowed_said[uid] = now
        log.info(
            "queue: uid %d's requests wait their turns: they have taken their share of the queue's time "
            "(%d %% of a core, %g s at once)",
            uid,
            round(SHARE * 100),
            SHARE_BURST,
        )

    def _write(self, conn: _Conn) -> None:
        """Hand the kernel what it takes of the page; a page taken whole: the next one is made on the
        next call (one page a call: a long answer never keeps the others waiting)."""
        if conn.sent >= len(conn.out) and not self._next_page(conn):
            return
        try:
            conn.sent += conn.sock.send(memoryview(conn.out)[conn.sent :])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if conn.sent >= len(conn.out):
            self._set_out(conn, b"")
            if conn.rest is None:
                self._close(conn)
            else:
                conn.deadline = time.monotonic() + CLIENT_SECONDS

    def _next_page(self, conn: _Conn) -> bool:
        """Make the answer's next page (True), or wait for answer bytes to be given back (parked), or
        close the connection after the last one."""
        if conn.rest is None:
            self._close(conn)
            return False
        if self._rest(conn):
            return False
        if not self.answers_held.fits(conn.peer.uid, PAGE_BYTES):
            self._park(conn)
            return False
        try:
            body = next(conn.rest, None)
        except Exception:  # a bug in making one listing must not end the server, nor be silent
            log.exception("queue: internal error making a page of an answer")
            body, conn.rest = _stopped(), None
        if body is None:
            self._close(conn)
            return False
        self._set_out(conn, _frame(self._noted(conn, Encoded(body))))
        return True

    def _set_out(self, conn: _Conn, out: bytes) -> None:
        """The page being sent (b"": none), counted in answers_held; given back: waiting answers go on."""
        conn.out, conn.sent = out, 0
        freed = conn.held_out - len(out)
        self.answers_held.give(conn.peer.uid, conn.held_out)
        self.answers_held.take(conn.peer.uid, len(out))
        conn.held_out = len(out)
        if freed > 0 and self.parked:
            self._unpark()

    def _park(self, conn: _Conn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.parked = True
        conn.deadline = time.monotonic() + PARK_SECONDS
        self.parked.append(conn)

    def _unpark(self) -> None:
        """The waiting answers that now fit go on, oldest first."""
        for conn in list(self.parked):
            if self.answers_held.fits(conn.peer.uid, PAGE_BYTES):
                self.parked.remove(conn)
                conn.parked = False
                conn.deadline = time.monotonic() + CLIENT_SECONDS
                self.sel.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            if conn.resting:
                waited = now - conn.rested_at
                self._refuse(
                    conn,
                    f"your requests have taken their share of the queue's time ({SHARE:.0%} of a core): "
                    f"this one waited {waited:.0f} s for its turn; ask less often",
                )
                continue
            if not conn.answered:
                log.debug("queue: uid %d pid %d sent no request in time", conn.peer.uid, conn.peer.pid)
                with contextlib.suppress(OSError):
                    conn.sock.send(encode({"ok": False, "error": "no request in time", "code": 2}))
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self.conns.pop(conn.sock.fileno(), None) is None:
            return
        uid = conn.peer.uid
        left = self.per_uid.get(uid, 0) - 1
        if left > 0:
            self.per_uid[uid] = left
        else:
            self.per_uid.pop(uid, None)
        if conn.parked:
            self.parked.remove(conn)
        if conn.resting:
            self.resting.remove(conn)
            conn.resting = False
        if conn.request is not None:
            self.checks.forget(conn)
            conn.request = None
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(conn.sock)
        conn.sock.close()
        conn.rest = None
        self.requests_held.give(uid, conn.held_in)
        conn.held_in = 0
        self._set_out(conn, b"")


def _left(sock: socket.socket) -> bool:
    """Whether the client has closed its end (or it broke)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _frame(answer: Union[dict, Encoded]) -> bytes:
    """The answer's frame; one that cannot be sent (too large) is a one-line error instead."""
    try:
        return encode(answer, MAX_ANSWER)
    except Exception as err:
        return encode({"ok": False, "error": str(err), "code": 1})


def _refusal(why: str) -> bytes:
    return encode({"ok": False, "error": why, "code": 1})


def _stopped() -> bytes:
    return b'{"ok":false,"error":"internal error making this answer (please report it)","code":1}'


def _max_connections() -> int:
    """Clients served at once: within the open-files limit, leaving the daemon room for its own files."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - 256))
