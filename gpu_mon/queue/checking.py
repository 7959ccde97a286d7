"""Submits whose check as their user (submitcheck.py) runs in a thread of its own, so that the queue's
server thread never waits on a user's file system: a `--output` on a mount that hangs costs its user's
submits the check's limit, never another user's request.

One check of a user runs at a time (the user's others wait their turn, in order), and at most MAX_AT_ONCE
for everyone, users served in turn; a connection waits for its check and is then answered by the server
thread. Written by hand: concurrent.futures would need the same per-user turns around it.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, Dict, Generic, List, Optional, Tuple, TypeVar

MAX_AT_ONCE = 8  # checks running at once, all users together

C = TypeVar("C")  # a connection, as the server holds it
Check = Callable[[], Optional[dict]]  # None: go on with the submit; else the refusal to send


class Checks(Generic[C]):
    """Runs checks in threads, a user's one at a time; `done()` (on the server thread) hands back each
    connection with its result; `wake` is called from a check's thread when one has ended."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.wake = wake
        self.waiting: Dict[int, Deque[Tuple[C, Check]]] = {}  # uid -> checks not yet started
        self.running: Dict[int, C] = {}  # uid -> the connection whose check runs
        self.finished: Deque[Tuple[int, C, Optional[dict]]] = collections.deque()
        self.lock = threading.Lock()

    def add(self, uid: int, conn: C, check: Check) -> None:
        """Run `check` for `conn` when the user's turn comes."""
        self.waiting.setdefault(uid, collections.deque()).append((conn, check))
        self._start_some()

    def done(self) -> List[Tuple[C, Optional[dict]]]:
        """The connections whose checks have ended, with their results (and the next checks started)."""
        with self.lock:
            ended, self.finished = list(self.finished), collections.deque()
        for uid, _conn, _result in ended:
            self.running.pop(uid, None)
        self._start_some()
        return [(conn, result) for _uid, conn, result in ended]

    def forget(self, conn: C) -> None:
        """A connection closed before its check started: its check is not run."""
        for uid, line in list(self.waiting.items()):
            kept = collections.deque((c, k) for c, k in line if c is not conn)
            if kept:
                self.waiting[uid] = kept
            else:
                del self.waiting[uid]

    def _start_some(self) -> None:
        for uid in list(self.waiting):
            if len(self.running) >= MAX_AT_ONCE:
                return
            if uid in self.running:
                continue
            conn, check = self.waiting[uid].popleft()
            if not self.waiting[uid]:
                del self.waiting[uid]
            self.running[uid] = conn
            thread = threading.Thread(target=self._run, args=(uid, conn, check), daemon=True)
            thread.name = "gpu-mon-check"
            thread.start()

    def _run(self, uid: int, conn: C, check: Check) -> None:
        try:
            result = check()
        except Exception as err:  # (a bug in one check: that submit is refused, the server goes on)
            result = {"ok": False, "error": f"cannot check the job: {type(err).__name__}", "code": 1}
        with self.lock:
            self.finished.append((uid, conn, result))
        self.wake()
