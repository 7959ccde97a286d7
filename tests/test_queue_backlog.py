"""A submit in a flood of someone else's connections: when the daemon's listen backlog is full, a unix
socket's connect fails at once (EAGAIN) instead of waiting as TCP's does; the client tries again until its
deadline, and says so in one line if the daemon never takes it (never a traceback)."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

import pytest

from gpu_mon.queue import protocol


def _full(path: Path) -> tuple:
    """A listening socket whose backlog is full (nothing accepts), and the connections that fill it."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    fillers = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(str(path))
        except BlockingIOError:
            c.close()
            break
        fillers.append(c)
    return server, fillers


def _serve_later(server: socket.socket, fillers: list, ready: threading.Event) -> None:
    """Once `ready`, empty the backlog, then answer the first connection that sends a request."""
    ready.wait(10)
    for c in fillers:
        c.close()
    while True:
        conn, _ = server.accept()
        with conn:
            head = conn.recv(4)
            if len(head) < 4:
                continue
            (size,) = struct.unpack(">I", head)
            body = b""
            while len(body) < size:
                body += conn.recv(size - len(body))
            conn.sendall(protocol.encode({"ok": True, "seen": len(body)}))
            return


def test_a_full_backlog_is_waited_out_not_a_traceback(tmp_path: Path):
    path = tmp_path / "q.sock"
    server, fillers = _full(path)
    ready = threading.Event()
    thread = threading.Thread(target=_serve_later, args=(server, fillers, ready), daemon=True)
    thread.start()
    timer = threading.Timer(0.3, ready.set)
    timer.start()
    try:
        answer = protocol.request(str(path), {"op": "jobs"}, timeout=10)
    finally:
        ready.set()
        thread.join(10)
        server.close()
    assert answer["ok"] is True and answer["seen"] > 0


def test_a_backlog_that_stays_full_is_one_line(tmp_path: Path):
    path = tmp_path / "q.sock"
    server, fillers = _full(path)
    try:
        with pytest.raises(protocol.NoDaemon, match=r"did not answer within 0\.3 s"):
            protocol.request(str(path), {"op": "jobs"}, timeout=0.3)
    finally:
        for c in fillers:
            c.close()
        server.close()
