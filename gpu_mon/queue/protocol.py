"""The queue socket's frames: a 4-byte big-endian length, then that many bytes of one JSON object.

A frame over MAX_FRAME, a length that is not followed by a JSON object, or anything else that is not a
frame is a ProtocolError (one line). The client side (`request`) is here too: one request, one answer.

A long answer (`jobs`) comes in pages: frames made one at a time as the client reads them, each but the
last with `"continued": true`; `request` joins their lists (`jobs`) and objects (`arrays`: each array's
shared values, in the page of its first element) into one answer. An answer that fits
one page is one frame, as before pages.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Union

MAX_FRAME = 1 << 20  # a request: a submit's 64 KiB command and 256 KiB environment fit, escaped, with room
MAX_ANSWER = 1 << 28  # one frame of an answer (a page of `jobs` is far less: about PAGE_BYTES and a job)
PAGE_BYTES = 256 * 1024  # a page of a long answer: jobs are added until it holds this many bytes
_HEADER = struct.Struct(">I")
DEFAULT_OUTPUT = ".local/state/gpu-mon/jobs"  # a job's output without --output: under the user's home, ID.log
_RECV = 1 << 18


class ProtocolError(Exception):
    """Bytes that are not a frame; str() is one line."""


class NoDaemon(Exception):
    """Nothing answers on the socket; str() is one line."""


@dataclass(frozen=True)
class Encoded:
    """A JSON object already encoded (a long answer put together from parts), sent as it is."""

    body: bytes


class Pages:
    """An answer made a page at a time: each item of `bodies` is one frame's JSON object, made only when
    the server is ready to send it (every one but the last with `"continued": true`)."""

    def __init__(self, bodies: Iterator[bytes]):
        self.bodies = bodies


def encode(obj: Union[dict, Encoded], limit: int = MAX_FRAME) -> bytes:
    """One frame."""
    body = obj.body if isinstance(obj, Encoded) else json.dumps(obj, separators=(",", ":")).encode("utf-8")
    if len(body) > limit:
        raise ProtocolError(f"message too large ({len(body)} bytes; at most {limit})")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Collects bytes until one whole frame is there."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> Optional[dict]:
        """Add bytes; the object once its frame is complete (taken out: the bytes after it stay for the
        next call), else None; ProtocolError for a bad frame."""
        self.buf += data
        if len(self.buf) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self.buf)
        if size > self.limit:
            raise ProtocolError(f"frame too large ({size} bytes; at most {self.limit})")
        if len(self.buf) < _HEADER.size + size:
            return None
        body = bytes(self.buf[_HEADER.size : _HEADER.size + size])
        del self.buf[: _HEADER.size + size]
        try:
            obj = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ProtocolError("not a JSON message") from None
        if not isinstance(obj, dict):
            raise ProtocolError("not a JSON object")
        return obj


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect; while the daemon's backlog is full (EAGAIN: a flood of connections, someone else's), try
    again a little later, until the deadline (a unix socket's connect does not wait, as TCP's does)."""
    pause = 0.001
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise socket.timeout from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def request(path: str, obj: dict, timeout: float = 30.0) -> dict:
    """Send one request to the daemon and return its answer; NoDaemon when nothing listens there."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            _connect(sock, path, deadline)
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoDaemon(
                f"no gpu-mon daemon answers on {path} (is it running with a [queue] section?)"
            ) from None
        except PermissionError:
            raise NoDaemon(f"{path}: permission denied") from None
        sock.sendall(encode(obj))
        reader = FrameReader(MAX_ANSWER)
        answer = _frame(sock, reader, deadline, path)
        while answer.pop("continued", False) is True:
            _join(answer, _frame(sock, reader, deadline, path))
        return answer
    except socket.timeout:
        raise NoDaemon(f"the daemon on {path} did not answer within {timeout:g} s") from None
    finally:
        sock.close()


def _frame(sock: socket.socket, reader: FrameReader, deadline: float, path: str) -> dict:
    """The next frame's object from the socket (or already read)."""
    obj = reader.feed(b"")
    while obj is None:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        data = sock.recv(_RECV)
        if not data:
            raise NoDaemon(f"the daemon on {path} closed the connection without an answer")
        obj = reader.feed(data)
    return obj


def _join(answer: dict, page: dict) -> None:
    """A page added to the answer so far: its lists extend the answer's, its objects add to the answer's
    (or are the answer's, the first time), `continued` says if more come."""
    if page.get("ok") is not True:  # (the daemon could not go on: say why)
        raise NoDaemon(f"the daemon stopped its answer: {page.get('error', 'no reason given')}")
    for key, value in page.items():
        old = answer.get(key)
        if isinstance(value, list) and isinstance(old, list):
            old.extend(value)
        elif isinstance(value, dict) and isinstance(old, dict):
            old.update(value)
        elif isinstance(value, (dict, str)) and key not in answer:  # (`slowed`: said in a later page)
            answer[key] = value
    answer["continued"] = page.get("continued", False)
