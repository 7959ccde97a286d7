"""The queue socket's client end for the commands answered before the CLI is imported (gpu_mon/entry.py:
`_job-ids` for a TAB, a common `submit`): one framed JSON request (a 4-byte big-endian length, then the
body; queue/protocol.py is the daemon's and the CLI's side) and its answer, with the standard library's
C socket module and struct alone (socket.py's enums take ~4 ms to build; typing 5-10 ms)."""

from __future__ import annotations

import struct

try:
    import _socket as socket
except ImportError:  # (not CPython)
    import socket  # type: ignore[no-redef]

DEFAULT_SOCKET = "/run/gpu_mon/queue.sock"  # = [queue] socket's default (a test checks)
DEFAULT_CONFIG = "/etc/gpu_mon.conf"  # = gpu_mon.config.DEFAULT_PATH (a test checks)
HEADER = struct.Struct(">I")


class NotSent(Exception):
    """Nothing was sent: nothing listens on the socket (or it cannot be reached)."""


class Failed(Exception):
    """After the request was sent: why no answer came (one line), and the exit status the CLI gives it."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def exchange(path: str, body: bytes, timeout: float, max_answer: int) -> bytes:
    """Send `body` as one frame on the socket at `path`; return the answer's body."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            raise NotSent(path) from None
        try:
            sock.sendall(HEADER.pack(len(body)) + body)
            return _answer(sock, path, max_answer)
        except socket.timeout:
            raise Failed(f"the daemon on {path} did not answer within {timeout:g} s", 1) from None
        except OSError as err:
            raise Failed(f"the daemon on {path}: {err.strerror or err}", 1) from None
    finally:
        sock.close()


def _answer(sock: socket.socket, path: str, max_answer: int) -> bytes:
    data = bytearray()
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        if len(data) >= HEADER.size and HEADER.unpack_from(data)[0] > max_answer:
            size = HEADER.unpack_from(data)[0]
            raise Failed(f"frame too large ({size} bytes; at most {max_answer})", 2)
        chunk = sock.recv(1 << 18)
        if not chunk:
            raise Failed(f"the daemon on {path} closed the connection without an answer", 1)
        data += chunk
    return bytes(data[HEADER.size : HEADER.size + HEADER.unpack_from(data)[0]])
