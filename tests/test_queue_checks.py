"""A submit's check as its user (its command, its output's directory) may wait on a file system that hangs
(a user's own FUSE mount, a dead NFS server): it runs in a thread of its own, so the queue's server thread
answers every other request meanwhile; a user's checks take turns, and a client that left before its check
ended gets nothing queued. The server here is the real one on a real socket and thread; the requests
behind it are a stand-in whose check waits for the test (a hanging file system cannot be made on demand)."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import List, Optional

from conftest import wait_for

from gpu_mon.queue.protocol import encode, request
from gpu_mon.queue.requests import Peer
from gpu_mon.queue.server import Server


class HangingChecks:
    """Requests whose submit check waits until `release` is set; every other request is answered at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.checking: List[str] = []
        self.submitted: List[str] = []

    def prepare(self) -> None:
        pass

    def check_submit(self, peer: Peer, req: dict) -> Optional[dict]:
        self.checking.append(req["name"])
        self.release.wait(30)
        return {"ok": False, "error": "refused", "code": 2} if req["name"] == "bad" else None

    def answer(self, peer: Peer, req: dict, checked: bool = False) -> dict:
        if req["op"] == "submit":
            assert checked, "a submit answered without its check"
            self.submitted.append(req["name"])
            return {"ok": True, "id": len(self.submitted)}
        return {"ok": True, "jobs": []}


def test_a_hanging_check_never_holds_up_another_request_and_a_users_checks_take_turns(tmp_path: Path):
    fake = HangingChecks()
    path = str(tmp_path / "queue.sock")
    server = Server(path, fake)  # type: ignore[arg-type]
    server.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(request, path, {"op": "submit", "name": "first"}, 30)
            bad = pool.submit(request, path, {"op": "submit", "name": "bad"}, 30)
            wait_for(lambda: fake.checking, 10, "the first check to run")
            began = time.monotonic()
            assert request(path, {"op": "jobs"}, 5) == {"ok": True, "jobs": []}
            assert time.monotonic() - began < 2.5  # (before: behind the check, as long as it hung)
            assert len(fake.checking) == 1  # the same user's second check waits its turn
            fake.release.set()
            assert first.result(30) == {"ok": True, "id": 1}
            assert bad.result(30) == {"ok": False, "error": "refused", "code": 2}
        assert fake.submitted == ["first"]
    finally:
        fake.release.set()
        server.stop()
    assert not os.path.exists(path)


def test_a_client_that_left_before_its_check_ended_gets_nothing_queued(tmp_path: Path):
    fake = HangingChecks()
    path = str(tmp_path / "queue.sock")
    server = Server(path, fake)  # type: ignore[arg-type]
    server.start()
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(path)
        client.sendall(encode({"op": "submit", "name": "gone"}))
        wait_for(lambda: fake.checking, 10, "its check to run")
        client.close()
        fake.release.set()
        wait_for(lambda: not server.checks.running and not server.conns, 10, "the check to end")
        assert request(path, {"op": "jobs"}, 5)["ok"]
        assert fake.submitted == []  # (before this check: queued, and the answer went nowhere)
    finally:
        fake.release.set()
        server.stop()
